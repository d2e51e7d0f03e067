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

from test_backend_numerics import GPT, LLAMA
from test_pipeline_numerics import FOUR_LAYERS, run_and_check

EIGHT_LAYERS = "&n_layer=8&batch=8"


# ---- numerics: the schedules train like one process ------------------------------------------

def run_and_check(world: int, cases: list[tuple[str, str]]) -> None:
    """Compile every case (fp32), train it on `world` gloo processes, compare with one process;
    the stages run unwrapped (no DDP: the split backward bypasses its reducer), outputs unviewed."""
    import shardc

    compiled = []
    for spec, plan in cases:
        model, inputs, names = build(spec)
        compiled.append((spec, shardc.compile(model, inputs, plan=f"{plan},dtype=fp32", input_names=names)))
    results = spawn(step_cases, world, compiled, timeout_s=600)
    for (spec, plan), (losses, full, wrappers) in zip(cases, results[0]):
        check(spec, plan, losses, full)
        assert wrappers == ["_Unviewed"], (spec, plan, wrappers)

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
