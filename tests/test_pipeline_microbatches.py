"""Micro-batch counts a pipeline schedule runs, and the removed `offload` key.

validate-plan refuses exactly the counts torch.distributed.pipelining refuses: its schedule
constructors are the judge (1F1B: m >= pp; interleaved 1F1B: m divisible by max(1, m // pp);
GPipe: any m), and GPipe and interleaved 1F1B with fewer micro-batches than stages train on two
gloo processes like one process does. The solver builds no 1F1B problem with m < pp.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_pipeline_numerics import FOUR_LAYERS, GPT, run_and_check

from shardc.driver import estimate
from shardc.hardware import parse_cluster
from shardc.ir.diagnostics import ShardcError
from shardc.ir.parser import parse
from shardc.plan.parallel import ParallelPlan, microbatch_problem, validate_plan
from shardc.search.outer import search
from shardc.search.problem import MeshShape, graph_facts

TINY = {"layers": 4, "heads": 4, "hidden": 64}


def _torch_accepts(schedule: str, pp: int, vpp: int, m: int) -> bool:
    """Whether torch's schedule class takes `m` micro-batches: its constructor runs its checks on
    stand-in stages (rank 0 of `pp`, `vpp` stages each) and raises ValueError when it refuses."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    stages = [SimpleNamespace(num_stages=pp * vpp, group_size=pp, group_rank=0, stage_index=k * pp,
                              is_first=k == 0, is_last=k == vpp - 1, submod=None) for k in range(vpp)]
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[schedule]
    try:
        cls(stages if vpp > 1 else stages[0], m)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("schedule, vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_refuses_exactly_what_torch_refuses(schedule: str, vpp: int) -> None:
    refused = []
    for pp in (2, 3, 4, 8):
        plan = ParallelPlan(pp=pp, vpp=vpp, schedule=schedule)
        for m in range(1, 25):
            assert (microbatch_problem(plan, m) is None) == _torch_accepts(schedule, pp, vpp, m), (plan, m)
            refused += [(pp, m)] if microbatch_problem(plan, m) else []
    if schedule == "gpipe":
        assert refused == []
    elif schedule == "1f1b":
        assert (2, 1) in refused and (8, 7) in refused and (8, 8) not in refused
    else:
        assert (2, 5) in refused and (2, 1) not in refused and (4, 3) not in refused


def _message(plan: str, devices: int = 2, **dims: int) -> str:
    with pytest.raises(ShardcError) as err:
        validate_plan(ParallelPlan.parse(plan), devices=devices, **{**TINY, **dims})  # type: ignore[arg-type]
    return str(err.value)


def test_messages_name_the_counts_and_valid_values() -> None:
    assert ("1 micro-batch per step for pp=2 stages: the 1F1B schedule needs at least as many micro-batches as "
            "stages (m = gbs/(dp*mb) >= 2); valid gbs with dp=1, mb=4: 8, 12, 16; valid mb with gbs=4: 1, 2; "
            "or schedule=gpipe, which runs fewer micro-batches than stages") in _message("pp=2,mb=4,gbs=4")
    msg = _message("dp=2,pp=4,gbs=4", devices=8)
    assert "2 micro-batches per step for pp=4 stages" in msg
    assert "valid gbs with dp=2, mb=1: 8, 10, 12; valid mb with gbs=4: none; or a smaller dp" in msg
    assert ("5 micro-batches per step for pp=2: interleaved 1F1B runs them in max(1, m // pp) = 2 rounds and "
            "needs m divisible by that") in _message("pp=2,vpp=2,gbs=5")
    assert "valid gbs with dp=1, mb=1: 3, 4, 6; valid mb with gbs=5: 5" in _message("pp=2,vpp=2,gbs=5")
    # the batch of the traced model counts when gbs=auto
    assert "1 micro-batch per step for pp=2 stages" in _message("pp=2", batch=1)
    for ok in ("pp=2,schedule=gpipe,gbs=1", "pp=2,vpp=2,gbs=1", "pp=2,vpp=2,gbs=6", "pp=2,gbs=2"):
        validate_plan(ParallelPlan.parse(ok), devices=2, **TINY)


def test_commands_refuse_before_torch_does() -> None:
    with pytest.raises(ShardcError, match=r"1 micro-batch per step for pp=2 stages.*valid mb with gbs=4: 1, 2"):
        estimate("examples/gpt.py:tiny?batch=4", "2xH100", "pp=2,mb=4")


def test_solver_builds_no_1f1b_problem_with_fewer_micro_batches_than_stages() -> None:
    from traced import PRESETS, transformer_graph

    graph, cluster = transformer_graph(PRESETS["tiny"]), parse_cluster("2xH100")
    with pytest.raises(ShardcError, match="at least as many micro-batches as pipeline stages with global batch 2"):
        search(graph_facts(graph, cluster), cluster, 2, 80e9, 5, shapes=[MeshShape(2, 1, 1, 1)], mbs=(2,))


def test_gpipe_and_interleaved_train_with_fewer_micro_batches_than_stages() -> None:
    run_and_check(2, [(GPT, "pp=2,schedule=gpipe,mb=4"),              # 1 micro-batch, 2 stages
                      (GPT + FOUR_LAYERS, "pp=2,vpp=2,mb=4")])        # 1 micro-batch, 4 virtual stages


def test_offload_is_refused_and_old_texts_still_read() -> None:
    with pytest.raises(ShardcError, match=r"(?s)plan key offload=1 .*optimizer-state offload to host memory is not "
                                          r"supported.*drop the offload key"):
        ParallelPlan.parse("dp=2,offload=1")
    old = "dp=2,tp=1,pp=1,vpp=1,cp=1,sp=0,mb=1,gbs=auto,schedule=1f1b,recompute=none,zero=0,dtype=bf16,offload=0"
    assert ParallelPlan.parse(old) == ParallelPlan(dp=2) and "offload" not in str(ParallelPlan.parse(old))
    text = "graph @g {\n  input %x : f32[2]\n  layer a block=a stage=0 recompute=none zero=0 offload=VALUE\n  return %x\n}\n"
    assert "offload" not in str(parse(text.replace("VALUE", "false")))
    with pytest.raises(ShardcError, match="layer a: offload=true is not supported"):
        parse(text.replace("VALUE", "true"))


def test_interleaved_timeline_is_torchs_order() -> None:
    """The cost model simulates interleaved 1F1B in torch's own op order (its `pipeline_order`),
    for the micro-batch counts torch accepts, fewer than stages and not multiples of pp included."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    from shardc.cost.pipeline import device_order

    compared = 0
    for p, v, m in ((2, 2, 1), (2, 2, 3), (2, 3, 6), (3, 2, 2), (4, 2, 3), (4, 2, 8), (4, 3, 10), (2, 2, 7)):
        stages = [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=k * p, is_first=k == 0,
                                  is_last=k == v - 1, submod=None) for k in range(v)]
        if not _torch_accepts("interleaved", p, v, m):
            with pytest.raises(ShardcError, match=f"interleaved 1F1B runs {m} micro-batches in"):
                device_order("interleaved", p, 0, m, v)
            continue
        order = ScheduleInterleaved1F1B(stages, m).pipeline_order  # type: ignore[arg-type]
        for d in range(p):
            theirs = [("F" if a.computation_type.name == "FORWARD" else "B", a.microbatch_index, a.stage_index)
                      for a in order[d] if a is not None]
            assert device_order("interleaved", p, d, m, v) == theirs, (p, v, m, d)
            compared += 1
    assert compared == 2 + 2 + 2 + 3 + 4 + 4 + 4
