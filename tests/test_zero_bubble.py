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
from shared_spawn import SharedRuns, spawn_jobs
from test_backend_numerics import GPT, LLAMA, build, check
from test_pipeline_numerics import FOUR_LAYERS, step_cases

from shardc.analysis.stages import device_stages, stage_device
from shardc.backends.torch.launch import spawn
from shardc.cost.pipeline import bubble_fraction, device_order, in_flight_order, simulate, torch_order
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan, microbatch_problem

EIGHT_LAYERS = "&n_layer=8&batch=8"


# ---- numerics: the schedules train like one process ------------------------------------------

def compile_all(cases: list[tuple[str, str]]) -> list[tuple[str, object]]:
    """Every case compiled (fp32: compared with the fp32 model), as `step_cases` takes them."""
    import shardc

    compiled = []
    for spec, plan in cases:
        model, inputs, names = build(spec)
        compiled.append((spec, shardc.compile(model, inputs, plan=f"{plan},dtype=fp32", input_names=names)))
    return compiled


def check_all(cases: list[tuple[str, str]], results: list, wrapper: str = "Unviewed") -> None:
    """Rank 0's results of `step_cases` against one process; the stages run without DDP (the split
    backward bypasses its reducer), outputs unviewed (and with ZeRO, that unviewed module is the
    stage's FSDP2 unit: `wrapper` FSDPUnviewed)."""
    for (spec, plan), (losses, full, wrappers) in zip(cases, results):
        check(spec, plan, losses, full)
        assert wrappers == [wrapper], (spec, plan, wrappers)


def run_and_check(world: int, cases: list[tuple[str, str]], wrapper: str = "Unviewed") -> None:
    """Compile every case (fp32), train it on `world` gloo processes, compare with one process."""
    check_all(cases, spawn(step_cases, world, compile_all(cases), timeout_s=600)[0], wrapper)


def test_zero_bubble_schedules_on_two_processes() -> None:
    run_and_check(2, [
        (GPT + FOUR_LAYERS, "pp=2,vpp=2,schedule=zbv"),            # V: rank 0 holds stages 0 and 3
        (LLAMA + FOUR_LAYERS, "pp=2,vpp=2,schedule=dualpipev"),    # 4 micro-batches for 4 stages
        (GPT, "pp=2,schedule=interleaved-zb"),                     # ZB1P, one stage per rank
        (LLAMA + FOUR_LAYERS, "pp=2,vpp=2,schedule=interleaved-zb"),
        (GPT + FOUR_LAYERS, "pp=2,vpp=2,schedule=zbv,recompute=full"),  # recomputed in I, kept for W
    ])


FOUR_PROCESSES = [
    (GPT + EIGHT_LAYERS, "pp=4,vpp=2,schedule=zbv"),
    (GPT + EIGHT_LAYERS, "pp=4,vpp=2,schedule=dualpipev"),
    (LLAMA + FOUR_LAYERS, "dp=2,pp=2,vpp=2,schedule=zbv"),     # gradients averaged over dp after the step
    (GPT, "tp=2,pp=2,schedule=interleaved-zb"),
]
FOUR_PROCESSES_ZERO = [
    (LLAMA + FOUR_LAYERS, "dp=2,pp=2,vpp=2,schedule=zbv,zero=1"),
    (LLAMA + FOUR_LAYERS, "dp=2,pp=2,vpp=2,schedule=interleaved-zb,zero=2"),
    (LLAMA + FOUR_LAYERS + "&batch=8", "dp=2,pp=2,vpp=2,schedule=dualpipev,zero=3"),  # m = 4 = 2pp
    (GPT + "&tie=false", "dp=2,pp=2,schedule=interleaved-zb,zero=3"),
]


@pytest.fixture(scope="module")
def on_four_processes() -> SharedRuns:
    """Both four-process tests' plans trained in one spawned group (`tests/shared_spawn.py`)."""
    return spawn_jobs(4, [lambda: (step_cases, (compile_all(FOUR_PROCESSES),)),
                          lambda: (step_cases, (compile_all(FOUR_PROCESSES_ZERO),))], timeout_s=600)


def test_zero_bubble_schedules_on_four_processes(on_four_processes: SharedRuns) -> None:
    check_all(FOUR_PROCESSES, on_four_processes[0][0])


def test_zero_bubble_schedules_with_zero_on_four_processes(on_four_processes: SharedRuns) -> None:
    """ZeRO under a split backward: every stage one FSDP2 unit, kept from syncing during its
    input- and weight-gradient passes and reduce-scattered by torch's runtime after the stage's
    last weight-gradient pass (REDUCE_GRAD). ZeRO-3 keeps the weights gathered through the step
there: resharding after each forward gave wrong weight gradients (losses off by 1e-4 relative at
the second step, zbv and interleaved-zb) where a W pass ran after a later forward."""
    check_all(FOUR_PROCESSES_ZERO, on_four_processes[1][0], wrapper="FSDPUnviewed")


def test_a_parameter_two_stages_of_one_rank_share_is_refused_under_fsdp2() -> None:
    """The V schedules put the first and last stage on rank 0: a tied embedding and head would
    be two FSDP2 units' parameter (sharded twice), so it is refused, naming it and the way out."""
    import torch

    from shardc.backends.torch.pipelined import _check_unshared
    from shardc.ir import Graph

    first, last = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
    last.weight = first.weight
    with pytest.raises(ShardcError, match=r"(?s)parameter weight of graph @tied is read by two virtual stages.*"
                                          r"FSDP2 cannot sync it.*untie it"):
        _check_unshared(Graph("tied"), [first, last], "FSDP2")
    _check_unshared(Graph("untied"), [first, torch.nn.Linear(4, 8)], "FSDP2")


# ---- placement -------------------------------------------------------------------------------

def test_v_schedules_place_stages_r_and_2p_minus_1_minus_r() -> None:
    assert [stage_device(s, 4, "zbv") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_device(s, 4, "dualpipev") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_device(s, 4, "interleaved-zb") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert device_stages(0, 4, 2, "zbv") == (0, 7)
    assert device_stages(3, 4, 2, "zbv") == (3, 4)
    assert device_stages(1, 2, 2, "interleaved") == (1, 3)


# ---- the simulation: torch's order, split backward, bubbles, activations in flight ----------

def _text(schedule: str, p: int, d: int, m: int, v: int) -> str:
    """Device d's order in torch's action spelling (stage, kind, micro-batch): `3I0` is stage 3's
    input gradient of micro-batch 0."""
    return " ".join(f"{s}{k}{j}" for k, j, s in device_order(schedule, p, d, m, v))


def test_per_device_order_is_torchs() -> None:
    """The orders torch's ScheduleZBVZeroBubble and ScheduleDualPipeV build for pp=2, m=4 (their
    `pipeline_order`, computation actions only; DualPipeV's overlapped pairs as F then B)."""
    assert _text("zbv", 2, 0, 4, 2) == ("0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 "
                                        "3F3 3I3 3W3 0I2 0W2 0I3 0W3")
    assert _text("zbv", 2, 1, 4, 2) == ("1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 "
                                        "2W2 1I2 2I3 1I3 1W2 2W3 1W3")
    assert _text("dualpipev", 2, 1, 4, 2) == ("1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 "
                                              "2W3 1W3")
    for schedule, v in (("zbv", 2), ("dualpipev", 2), ("interleaved-zb", 1), ("interleaved-zb", 2)):
        p, m = 4, 8
        for d in range(p):
            ops = device_order(schedule, p, d, m, v)
            assert {s for _, _, s in ops} == set(device_stages(d, p, v, schedule)), (schedule, d)
            done = {(j, s): {k for k, jj, ss in ops if (jj, ss) == (j, s)} for _, j, s in ops}
            assert all(k in ({"F", "B"}, {"F", "I", "W"}) for k in done.values()), (schedule, d, done)
            assert len(done) == m * v
    assert torch_order("zbv", 2, 4, 2)[0] == device_order("zbv", 2, 0, 4, 2)


def test_zero_bubble_beats_1f1b_at_equal_micro_batches_on_equal_stages() -> None:
    """Equal stages, the same work per device (F = 1, B = I + W = 2 per micro-batch and device):
    1F1B idles (p-1)/(m+p-1) of its time; the zero-bubble schedules fill most of it with W."""
    for p, m in ((2, 4), (4, 8), (4, 16)):
        one = simulate("1f1b", [1.0] * p, [2.0] * p, m, p)
        assert one.makespan == pytest.approx(3.0 * (m + p - 1))
        zbv = simulate("zbv", [0.5] * 2 * p, [1.0] * 2 * p, m, p, wgrad=[0.5] * 2 * p)
        zb1p = simulate("interleaved-zb", [1.0] * p, [2.0] * p, m, p, wgrad=[1.0] * p)
        assert sum(zbv.busy) == pytest.approx(sum(one.busy))
        assert zbv.makespan < zb1p.makespan < one.makespan, (p, m, zbv.makespan, zb1p.makespan, one.makespan)
        assert bubble_fraction(p, m, 2, "zbv") < bubble_fraction(p, m, 1, "interleaved-zb") \
            < bubble_fraction(p, m, 1, "1f1b") == pytest.approx((p - 1) / (m + p - 1))
    # Without a weight-gradient part to defer, the split backward has nothing to fill bubbles with.
    assert simulate("interleaved-zb", [1.0] * 4, [2.0] * 4, 8, 4).makespan >= \
        simulate("1f1b", [1.0] * 4, [2.0] * 4, 8, 4).makespan


def test_activations_in_flight_per_schedule() -> None:
    """ZB-V holds 2p model chunks (half a device's layers each) on every device: the memory of
    1F1B's first stage (p micro-batches), on all of them; DualPipeV one chunk more."""
    assert [in_flight_order("1f1b", 4, d, 8, 1) for d in range(4)] == [4, 3, 2, 1]
    assert [in_flight_order("zbv", 4, d, 8, 2) for d in range(4)] == [8, 8, 8, 8]
    assert [in_flight_order("dualpipev", 4, d, 8, 2) for d in range(4)] == [9, 9, 9, 9]


# ---- the backward split of a layer ---------------------------------------------------------

def test_weight_gradient_share_of_mlp_and_attention_layers() -> None:
    """Linears with a weight: half their backward is W. The attention core's matmuls (two
    activations) are all input gradient, so an attention layer's share is below half."""
    from shardc import driver
    from shardc.cost.pipeline import weight_gradient_share

    graph, _ = driver.partition("examples/gpt.py:tiny", None, "pp=2")
    by_layer: dict[str, list] = {}
    for node in graph.nodes:
        by_layer.setdefault(node.layer or "", []).append(node)
    mlp = [n for n in by_layer["blocks.0"] if ".mlp." in n.location.module_path]
    attn = [n for n in by_layer["blocks.0"] if ".attn" in n.location.module_path]
    assert weight_gradient_share(mlp) == pytest.approx(0.5)
    assert 0.2 < weight_gradient_share(attn) < 0.5
    assert 0.3 < weight_gradient_share(by_layer["blocks.0"]) < 0.5


# ---- what torch's schedules cannot run is refused, naming the key -----------------------------

def test_invalid_zero_bubble_plans_are_refused() -> None:
    with pytest.raises(ShardcError, match=r"(?s)schedule=zbv with vpp=1.*exactly two virtual stages"):
        ParallelPlan.parse("pp=2,schedule=zbv")
    with pytest.raises(ShardcError, match=r"schedule=dualpipev with vpp=3"):
        ParallelPlan.parse("pp=2,vpp=3,schedule=dualpipev")
    with pytest.raises(ShardcError, match=r"schedule=interleaved-zb with pp=1"):
        ParallelPlan.parse("schedule=interleaved-zb")
    assert ParallelPlan.parse("dp=2,pp=2,vpp=2,schedule=zbv,zero=3").zero == 3  # FSDP2 stage units
    plan = ParallelPlan.parse("pp=2,vpp=2,schedule=dualpipev")
    assert microbatch_problem(plan, 3) is not None and "DualPipeV needs at least" in str(microbatch_problem(plan, 3))
    assert microbatch_problem(plan, 4) is None
    assert "interleaved zero bubble" in str(microbatch_problem(ParallelPlan.parse("pp=2,schedule=interleaved-zb"), 5))
    assert microbatch_problem(ParallelPlan.parse("pp=4,vpp=2,schedule=zbv"), 1) is None
    assert str(ParallelPlan.parse("pp=2,vpp=2,schedule=interleaved_zb")).endswith(
        "schedule=interleaved-zb,recompute=none,zero=0,dtype=bf16")


def _torch_accepts(schedule: str, pp: int, vpp: int, m: int) -> bool:
    """Whether torch's zero-bubble class takes `m` micro-batches: its constructor on stand-in
    stages (rank 0 of `pp`, with the placement's stages) raises ValueError when it refuses."""
    from types import SimpleNamespace

    import torch.distributed.pipelining as tpp

    cls = getattr(tpp, {"zbv": "ScheduleZBVZeroBubble", "interleaved-zb": "ScheduleInterleavedZeroBubble",
                        "dualpipev": "ScheduleDualPipeV"}[schedule])
    mine = device_stages(0, pp, vpp, schedule)
    stages = [SimpleNamespace(num_stages=pp * vpp, group_size=pp, group_rank=0, stage_index=s, is_first=s == 0,
                              is_last=s == pp * vpp - 1, submod=None) for s in mine]
    try:
        cls(stages, m)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("schedule, vpp", [("zbv", 2), ("dualpipev", 2), ("interleaved-zb", 1), ("interleaved-zb", 2)])
def test_micro_batch_counts_refused_exactly_as_torch_refuses(schedule: str, vpp: int) -> None:
    for pp in (2, 3, 4):
        plan = ParallelPlan(pp=pp, vpp=vpp, schedule=schedule)
        for m in range(1, 17):
            assert (microbatch_problem(plan, m) is None) == _torch_accepts(schedule, pp, vpp, m), (plan, m)


def test_estimate_prints_each_schedules_bubble_and_zero_bubble_is_faster() -> None:
    """`shardc estimate` prints the balanced bubble of the plan's schedule (`bubble_fraction`), and
    on a pipeline-bound model the zero-bubble schedules' predicted step is below 1F1B's."""
    import contextlib
    import io
    import re

    from shardc.cli import main

    spec = "examples/gpt.py:gpt2_small?n_layer=16"
    steps = {}
    for schedule, vpp in (("1f1b", 1), ("interleaved-zb", 1), ("zbv", 2), ("dualpipev", 2)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["estimate", spec, "--cluster", "8xA100-80GB",
                         "--plan", f"dp=2,pp=4,vpp={vpp},mb=1,gbs=32,schedule={schedule}"]) == 0
        text = out.getvalue()
        bubble = re.search(r"pipeline bubble \(balanced\)\s*│\s*([\d.]+)%", text)
        assert bubble is not None, text
        assert float(bubble.group(1)) == pytest.approx(100 * bubble_fraction(4, 16, vpp, schedule), abs=0.05)
        found = re.search(r"step time\s*│\s*([\d.]+) ms", text)
        assert found is not None, text
        steps[schedule] = float(found.group(1))
    assert steps["zbv"] < steps["interleaved-zb"] < steps["1f1b"], steps
    assert steps["dualpipev"] <= steps["interleaved-zb"], steps
