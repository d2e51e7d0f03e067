"""Zero-bubble pipeline schedules (plan key schedule=zbv|interleaved-zb|dualpipev): executed by
torch's ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble and ScheduleDualPipeV on real gloo
groups and compared with one process; priced by `shardc.cost.pipeline` with the backward split
into input- and weight-gradient passes in torch's own order; refused with a ShardcError naming
the key where torch's schedules cannot run the plan.

Numerics as tests/test_pipeline_numerics.py: 3 AdamW steps of `module.step`, losses and every
parameter afterwards within 1e-5 relative of one process (fp32). The V schedules place pp rank
r's stages at r and 2pp-1-r (the tied embedding and head of the tiny GPT then sit on one rank).
"""

from __future__ import annotations

import pytest
from test_backend_numerics import GPT, LLAMA
from test_pipeline_numerics import FOUR_LAYERS, run_and_check

from shardc.analysis.stages import device_stages, stage_device
from shardc.cost.pipeline import bubble_fraction, device_order, in_flight_order, simulate, torch_order
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan, microbatch_problem

EIGHT_LAYERS = "&n_layer=8&batch=8"


# ---- numerics: the schedules train like one process ------------------------------------------

def test_zero_bubble_schedules_on_two_processes() -> None:
    run_and_check(2, [
        (GPT + FOUR_LAYERS, "pp=2,vpp=2,schedule=zbv"),            # V: rank 0 holds stages 0 and 3
        (LLAMA + FOUR_LAYERS, "pp=2,vpp=2,schedule=dualpipev"),    # 4 micro-batches for 4 stages
        (GPT, "pp=2,schedule=interleaved-zb"),                     # ZB1P, one stage per rank
        (LLAMA + FOUR_LAYERS, "pp=2,vpp=2,schedule=interleaved-zb"),
    ])


def test_zero_bubble_schedules_on_four_processes() -> None:
    run_and_check(4, [
        (GPT + EIGHT_LAYERS, "pp=4,vpp=2,schedule=zbv"),
        (GPT + EIGHT_LAYERS, "pp=4,vpp=2,schedule=dualpipev"),
        (LLAMA + FOUR_LAYERS, "dp=2,pp=2,vpp=2,schedule=zbv"),     # gradients averaged over dp after the step
        (GPT, "tp=2,pp=2,schedule=interleaved-zb"),
    ])
