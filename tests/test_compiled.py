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
from shared_spawn import SharedRuns, spawn_jobs
from test_backend_numerics import GPT, check, compile_case, run_cases
from test_pipeline_numerics import check_cases, compile_cases, step_cases

from shardc.backends.torch.parallelize import runs_compiled
from shardc.cost import estimate
from shardc.cost.fusion import EXTERN_KINDS, fusion_chains
from shardc.driver import load
from shardc.frontend import trace
from shardc.frontend.spec import load_model
from shardc.hardware import parse_cluster
from shardc.ir import Graph
from shardc.ir.diagnostics import ShardcError
from shardc.ops.registry import get_op
from shardc.passes.apply_plan import apply_plan
from shardc.passes.group_layers import group_layers
from shardc.plan.parallel import ParallelPlan, plan_of
from shardc.search.evaluate import evaluate
from shardc.search.grid import grid_assignments
from shardc.search.planfile import annotate_graph
from shardc.search.problem import MeshShape, build_problem, graph_facts

COMPILED_CASES = [(GPT, "dp=2,compile=1", ""), (GPT, "tp=2,compile=1", "")]


def _compiled_run(rank: int, world: int, cases: list) -> tuple[list, int, int, int]:
    """`run_cases` on this rank; how many graphs dynamo compiled on the way, how many graph
    breaks it made and how many attention cores inductor rewrote into sdpa."""
    from torch._dynamo.utils import counters

    results = run_cases(rank, world, cases)
    breaks = sum(counters["graph_break"].values())
    return results, int(counters["stats"]["unique_graphs"]), breaks, int(counters["inductor"]["fuse_attention"])


COMPILED_PIPELINE_CASES = [(GPT, "pp=2,compile=1")]


@pytest.fixture(scope="module")
def on_two_processes() -> SharedRuns:
    """Both two-process tests' plans trained in one spawned group (`tests/shared_spawn.py`):
    the flat plans first, so that dynamo's counters read by `_compiled_run` are theirs alone."""
    flat = lambda: (_compiled_run, ([(spec, compile_case(spec, plan, edit), edit)  # noqa: E731
                                     for spec, plan, edit in COMPILED_CASES],))
    return spawn_jobs(2, [flat, lambda: (step_cases, (compile_cases(COMPILED_PIPELINE_CASES),))], timeout_s=900)


def test_compiled_dp2_and_tp2_train_like_one_eager_process(on_two_processes: SharedRuns) -> None:
    per_rank = on_two_processes[0]
    for rank, (_, graphs, breaks, sdpa) in enumerate(per_rank):
        # one graph per plan: the collectives are traced, not graph breaks
        assert (graphs, breaks) == (len(COMPILED_CASES), 0), f"rank {rank}: {graphs} graphs, {breaks} graph breaks"
        # priced = executed: `shardc.cost.fusion` assumes the written-out attention is not rewritten
        assert sdpa == 0, f"rank {rank}: inductor rewrote {sdpa} attention cores into sdpa; price them so"
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




# ---- pricing what inductor produces ------------------------------------------------------------

HF_TINY = "hf:gpt2?n_layer=1&n_embd=64&n_head=4&vocab_size=128&n_positions=16&seq=16&batch=2"


def _partitioned(spec: str, plan: str) -> Graph:
    loaded = load_model(spec, device="meta")
    graph = group_layers(trace(loaded.model, loaded.example_inputs, name=loaded.name, input_names=loaded.input_names))
    return apply_plan(graph, ParallelPlan.parse(plan))


def _kernels(spec: str, layer: str) -> str:
    """The fused kernels of one block under tp=2 (its fusion chains, one a line; matmuls apart)."""
    nodes = _partitioned(spec, "tp=2").layer_nodes(layer)
    fusible = {n: get_op(n.op).kind not in EXTERN_KINDS for n in nodes}
    return "\n".join(" ".join(n.op for n in chain) for chain in fusion_chains(nodes, fusible))


def test_fusion_chains_of_a_gpt_block_and_of_transformers_gpt2() -> None:
    assert _kernels("examples/gpt.py:tiny", "blocks.0") == """\
layer_norm
split reshape permute reshape permute reshape permute permute
mul masked_fill softmax dropout
permute reshape
dropout add layer_norm
gelu
dropout add"""
    # tanh GELU's eight ops are one kernel with the fc bias add before it (Conv1D: matmul + add);
    # the mask's logical_not, which depends on no matmul, is computed inside the softmax kernel
    assert _kernels(HF_TINY, "transformer.h.0") == """\
layer_norm reshape
add reshape split reshape permute reshape permute reshape permute permute
mul logical_not masked_fill softmax dropout
permute reshape reshape
add reshape dropout add layer_norm reshape
add reshape mul pow mul add mul tanh add mul reshape
add reshape dropout add"""


MEGATRON_3_6B = "n_layer=30&n_embd=3072&n_head=32&vocab_size=51200&seq=2048&batch=32"
PLAN_3_6B = "dp=32,tp=2,mb=1,gbs=512,recompute=full,dtype=fp16"


def _tflops(spec: str, plan: str) -> float:
    graph = _partitioned(spec, plan)
    return estimate(graph, parse_cluster("64xA100-80GB"), ParallelPlan.parse(plan)).tflops_per_device


def test_transformers_gpt2_and_examples_gpt_priced_alike_when_compiled() -> None:
    """Megatron's 3.6B configuration (h=3072, 32 heads, 30 layers, s=2048, V=51200) on 64 A100s,
    tp=2: eager, GPT-2's tanh GELU, bias adds and mask ops cost HF's model ~15% of its throughput;
    compiled (the default on GPUs), every chain of them is one fused kernel in both models."""
    ours = f"examples/gpt.py:gpt?{MEGATRON_3_6B}&dropout=0.1"
    theirs = f"hf:gpt2?{MEGATRON_3_6B.replace('seq=2048', 'seq=2048&n_positions=2048')}"
    eager = _tflops(ours, PLAN_3_6B + ",compile=0"), _tflops(theirs, PLAN_3_6B + ",compile=0")
    fused = _tflops(ours, PLAN_3_6B), _tflops(theirs, PLAN_3_6B)
    assert eager[1] < 0.9 * eager[0], f"eager: gpt.py {eager[0]:.1f}, hf:gpt2 {eager[1]:.1f} TFLOP/s"
    assert fused[1] == pytest.approx(fused[0], rel=0.03), f"compiled: gpt.py {fused[0]:.1f}, hf:gpt2 {fused[1]:.1f}"
    assert fused[0] > eager[0]  # fusion and flash attention only remove memory traffic and launches


def test_the_solver_prices_compiled_plans_as_the_estimate_does() -> None:
    """The solver's evaluation of the traced GPT's grid plans on A100s (fused prices, the GPU
    default) equals `estimate` of the plan it writes; told compile=0 on a GPU, the plan it
    writes says so and the estimate prices it eager."""
    graph = load("examples/gpt.py:tiny?n_layer=4&n_embd=256&n_head=8&seq=128&dropout=0.1", batch=2)
    cluster = parse_cluster("8xA100-80GB")
    for compiled in (None, False):
        facts = graph_facts(graph, cluster, compiled=compiled)
        for shape in (MeshShape(1, 2, 1, 4), MeshShape(4, 2, 1, 1)):
            problem = build_problem(facts, cluster, shape, 2, 32)
            for _, a in grid_assignments(problem):
                ev = evaluate(problem, a, float("inf"))
                annotated = annotate_graph(graph, problem, a)
                assert ("compile=0" in str(plan_of(annotated))) == (compiled is False)
                est = estimate(annotated, cluster)
                assert ev.step_time_s == pytest.approx(est.step_time_s, rel=0.01)
                assert ev.memory_per_device_bytes == pytest.approx(est.memory_per_device_bytes, rel=0.01)


def test_compiled_pipeline_stages_train_like_one_eager_process(on_two_processes: SharedRuns) -> None:
    """pp=2 (1F1B over 4 micro-batches): every stage module and the loss module compiled."""
    check_cases(COMPILED_PIPELINE_CASES, on_two_processes[1][0])
