"""Recomputation executes what the cost model prices (issue 13).

- The attention core (`shardc.analysis.attention`) of each example: QK^T through PV for
  attention written out as matmuls (GPT, BERT, transformers' GPT-2), none for fused sdpa
  (Llama); the cost model's `attention_core` is the same set.
- Codegen: `selective` checkpoints exactly the core, as a module of its own inside the layer;
  `full` checkpoints the layer; the embedding and the head are never recomputed.
- apply-plan: recompute on blocks only; `recompute_layers=N` the first N of each model chunk.
- Numerics on gloo: selective, full and mixed per-layer plans (recompute_layers, a plan file's
  stage counts) match one process, with and without a pipeline.
- Memory: measured peak per rank for none / selective / full within 5% of the prediction,
  ordered none > selective > full, and the savings as predicted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_backend_numerics import GPT, HF_GPT2, LLAMA, build, check
from test_backend_numerics import run_and_check as run_flat
from test_eject import ejected_worker, reference_losses
from test_pipeline_numerics import step_cases

import shardc
from shardc.analysis.attention import attention_core, batch_dependent, layer_nodes
from shardc.backends.torch.codegen import generate, module_code
from shardc.backends.torch.eject import eject_plan
from shardc.backends.torch.launch import spawn
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan

GPT4 = GPT + "&n_layer=4"
BERT = "examples/bert.py:tiny"
CLUSTER = "2xA100-80GB"
# transformers' GPT-2 writes attention out as matmuls (its eager path) when attention dropout is on.
HF_EAGER = HF_GPT2.replace("attn_pdrop=0", "attn_pdrop=0.1")
ONE_MICRO_BATCH = "examples/gpt.py:tiny"  # batch 2: one sequence per rank under dp=2, as `make demo` runs


def _graph(spec: str, plan: str = "recompute=selective"):
    model, inputs, names = build(spec)
    return shardc.compile(model, inputs, plan=plan, input_names=names).runtime_graph


def _cores(graph) -> dict[str, list[str]]:
    batched = batch_dependent(graph)
    return {name: [n.op for n in graph.nodes if n in attention_core(nodes, batched)]
            for name, nodes in layer_nodes(graph).items() if name is not None}


@pytest.mark.parametrize("spec, core", [
    (GPT, ["matmul", "mul", "masked_fill", "softmax", "dropout", "matmul"]),
    (BERT, ["matmul", "div", "add", "softmax", "dropout", "matmul"]),
    (HF_EAGER, ["matmul", "mul", "logical_not", "masked_fill", "softmax", "dropout", "matmul"]),
    (LLAMA, []),  # scaled_dot_product_attention: fused, nothing quadratic to drop
])
def test_the_attention_core_of_each_example(spec: str, core: list[str]) -> None:
    from shardc.cost.context import CostContext
    from shardc.cost.layer import attention_core as cost_core
    from shardc.hardware import parse_cluster

    graph = _graph(spec)
    cores = _cores(graph)
    blocks = [name for name, layer in graph.layers.items() if layer.block != name]
    assert blocks and all(cores[b] == core for b in blocks), cores
    assert all(not cores[n] for n in cores if n not in blocks)  # the embedding and head have none
    ctx = CostContext.build(graph, parse_cluster(CLUSTER), "f32")
    for nodes in layer_nodes(graph).values():  # the cost model prices the same nodes
        assert cost_core(ctx, nodes) == attention_core(nodes, batch_dependent(graph))


def _core_module(module: torch.nn.Module, layer: str) -> torch.fx.GraphModule:
    return module.get_submodule(f"{layer}.attention_core")  # type: ignore[return-value]


def test_generated_code_checkpoints_exactly_what_each_annotation_says() -> None:
    code = {r: module_code(generate(_graph(GPT, f"recompute={r}"), 0)) for r in ("none", "selective", "full")}
    assert len(set(code.values())) == 3
    assert "checkpoint" not in code["none"]
    root_full = code["full"].split("# ---- embed")[0]
    assert "checkpoint(blocks_0, " in root_full and "checkpoint(blocks_1, " in root_full
    assert "self.embed(" in root_full and "self.head(" in root_full  # never recomputed
    assert "checkpoint(attention_core, x11, x16, attn_future, x15, use_reentrant = False)" in code["selective"]
    assert "checkpoint(blocks" not in code["selective"]
    graph = _graph(GPT)
    module = generate(graph, 0)
    batched = batch_dependent(graph)
    for layer in ("blocks.0", "blocks.1"):
        core = attention_core(layer_nodes(graph)[layer], batched)
        sub = _core_module(module, layer)
        ran = [n.name for n in sub.graph.nodes if n.op == "call_function"]
        assert ran == [n.outputs[0].name for n in graph.nodes if n in core]
        assert [n.name for n in sub.graph.nodes if n.op == "output"] and len(sub.graph.output_node().args[0]) == 1
    # Fused attention has no core: selective runs as none.
    llama = {r: module_code(generate(_graph(LLAMA, f"recompute={r}"), 0)) for r in ("none", "selective")}
    assert llama["none"] == llama["selective"]


def test_apply_plan_recomputes_blocks_and_the_first_n_of_each_chunk() -> None:
    def annotations(plan: str) -> dict[str, tuple[int | None, str]]:
        g = _graph(GPT4, plan)
        return {n: (layer.annotation.stage, layer.annotation.recompute) for n, layer in g.layers.items()}

    assert annotations("recompute=full") == {"embed": (0, "none"), "blocks.0": (0, "full"), "blocks.1": (0, "full"),
                                             "blocks.2": (0, "full"), "blocks.3": (0, "full"), "head": (0, "none")}
    assert annotations("pp=2,recompute=selective,recompute_layers=1") == {
        "embed": (0, "none"), "blocks.0": (0, "selective"), "blocks.1": (0, "none"), "blocks.2": (1, "selective"),
        "blocks.3": (1, "none"), "head": (1, "none")}
    assert annotations("recompute=full,recompute_layers=0")["blocks.0"] == (0, "none")
    with pytest.raises(ShardcError, match=r"recompute_layers=3 but a pipeline model chunk holds at most 2 of the 4"):
        _graph(GPT4, "pp=2,recompute=full,recompute_layers=3")  # validate-plan
    from shardc.plan.parallel import check_recompute_layers

    with pytest.raises(ShardcError, match=r"chunks hold at most 3 blocks \(3\+1 over pp\*vpp = 2 chunks\)"):
        check_recompute_layers(ParallelPlan.parse("pp=2,recompute=full,recompute_layers=4"), [3, 1])  # split=3+1


def test_recompute_layers_plan_key() -> None:
    plan = ParallelPlan.parse("pp=2,recompute=selective,recompute_layers=2")
    assert plan.recompute_layers == 2 and ParallelPlan.parse(str(plan)) == plan
    assert "recompute=selective,recompute_layers=2,zero=0" in str(plan)
    assert "recompute_layers" not in str(ParallelPlan.parse("recompute=full,recompute_layers=all"))
    with pytest.raises(ShardcError, match="recompute_layers=1 has no effect with recompute=none"):
        ParallelPlan.parse("recompute_layers=1")
    with pytest.raises(ShardcError, match=r"recompute_layers='-1': expected an integer >= 0 or all"):
        ParallelPlan.parse("recompute=full,recompute_layers=-1")


def test_flat_plans_with_recomputation_match_single_process() -> None:
    assert run_flat(2, [
        (GPT, "dp=2,recompute=selective", ""),
        (GPT, "dp=2,recompute=full", ""),
        (GPT, "tp=2,recompute=selective", ""),                   # heads split inside the core
        (GPT, "cp=2,recompute=selective", ""),                   # keys gathered inside the core, again in backward
        (GPT4, "dp=2,recompute=selective,recompute_layers=1", ""),  # mixed: selective, none, ...
    ]) == []


def _dropout_losses(rank: int, world: int, compiled: list) -> list[list[float]]:
    out = []
    for plan in compiled:
        model, inputs, _ = build(HF_EAGER)
        module = plan.parallelize(model)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        torch.manual_seed(5)  # the same dropout masks for every plan, unless recomputation drew new ones
        losses = []
        for _ in range(3):
            loss = module(*inputs)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.append(losses)
    return out


def test_dropout_inside_the_core_recomputes_the_same_mask() -> None:
    """transformers' GPT-2 with attention dropout 0.1: the core's dropout runs again in backward
    under the forward's RNG state, so none, selective and full train alike."""
    compiled = []
    for r in ("none", "selective", "full"):
        model, inputs, names = build(HF_EAGER)
        compiled.append(shardc.compile(model, inputs, plan=f"recompute={r}", input_names=names))
    assert "attention_core" in module_code(generate(compiled[1].runtime_graph, 0))
    none, selective, full = spawn(_dropout_losses, 1, compiled)[0]
    assert selective == pytest.approx(none, rel=1e-6) and full == pytest.approx(none, rel=1e-6)


def _plan_file_graph(spec: str, tmp_path: Path):
    """A pp=2 plan file whose stages count (none, selective, full) blocks (1, 1, 0) and (0, 1, 1),
    as the solver writes it, partitioned back onto a fresh trace (`partitioned_graph`)."""
    from shardc.driver import load
    from shardc.hardware import parse_cluster
    from shardc.plan.file import PlanFile
    from shardc.search.evaluate import Assignment
    from shardc.search.planfile import partitioned_graph, plan_file
    from shardc.search.problem import MeshShape, build_problem, graph_facts

    cluster = parse_cluster(CLUSTER)
    plan = ParallelPlan.parse("pp=2,mb=1,gbs=4,dtype=fp32")
    problem = build_problem(graph_facts(load(spec, batch=4), cluster, "fp32"), cluster, MeshShape.of(plan), 1, 4, "fp32")
    labels = [[c.label for c in v.cands] for v in problem.groups]
    choice = tuple(lab.index("partition<>") for lab in labels)  # nothing split: pp only

    class Scores:
        step_time_s, memory_per_device_bytes = 1.0, 1.0

    plan_file(problem, Assignment(choice, ((1, 1, 0), (0, 1, 1)), 0), Scores, 4).save(tmp_path / "plan.json")
    return partitioned_graph(load(spec, batch=4), cluster, PlanFile.load(tmp_path / "plan.json"))


def test_pipelines_with_per_layer_recomputation_match_single_process(tmp_path: Path) -> None:
    graph = _plan_file_graph(GPT4, tmp_path)
    assert {n: layer.annotation.recompute for n, layer in graph.layers.items()} == {
        "embed": "none", "blocks.0": "selective", "blocks.1": "none", "blocks.2": "full", "blocks.3": "selective",
        "head": "none"}
    cases = [(GPT, "pp=2,recompute=selective,dtype=fp32"), (GPT4, "pp=2,recompute=selective,recompute_layers=1,dtype=fp32"),
             (GPT4, "plan file")]
    compiled = []
    for spec, plan in cases:
        model, inputs, names = build(spec)
        compiled.append((spec, shardc.compile(model, inputs, plan=graph if plan == "plan file" else plan,
                                              input_names=names)))
    stage0 = module_code(generate(compiled[2][1].runtime_graph, 0))
    assert "attention_core" in stage0 and "checkpoint(blocks_2" in stage0
    for (spec, plan), (losses, full, _) in zip(cases, spawn(step_cases, 2, compiled, timeout_s=600)[0]):
        check(spec, plan, losses, full)


def _peaks(rank: int, world: int, compiled: list) -> list[int]:
    """This rank's measured peak (the training loop's `MemoryTracker` step) under each plan."""
    from shardc.train import TrainOptions, train

    return [train(plan, ONE_MICRO_BATCH, TrainOptions(steps=1, warmup=1)).peak_memory_bytes for plan in compiled]


def test_measured_peak_memory_follows_the_prediction() -> None:
    """As `shardc run` measures and predicts (fp32 on CPU; the prediction for a preset cluster:
    memory does not depend on the device's speed), one process group for the three plans."""
    from shardc.driver import estimate

    recomputes = ("none", "selective", "full")
    plans = [f"dp=2,recompute={r},dtype=fp32" for r in recomputes]
    predicted = dict(zip(recomputes, (estimate(ONE_MICRO_BATCH, CLUSTER, p)[0].stages[0].memory_bytes
                                      for p in plans)))
    model, inputs, names = build(ONE_MICRO_BATCH)
    compiled = [shardc.compile(model, inputs, plan=p, input_names=names) for p in plans]
    for k, peaks in enumerate(spawn(_peaks, 2, compiled, timeout_s=600)):
        measured = dict(zip(recomputes, peaks))
        for r in recomputes:
            assert abs(measured[r] - predicted[r]) <= 0.05 * predicted[r], (k, r, measured, predicted)
        assert measured["none"] > measured["selective"] > measured["full"], measured
        for r in ("selective", "full"):  # what recomputation saves, measured and predicted
            saved, want = measured["none"] - measured[r], predicted["none"] - predicted[r]
            assert abs(saved - want) <= 0.1 * want, (k, r, saved, want)


def test_ejected_full_recomputation_runs_and_matches(tmp_path: Path) -> None:
    spec = f"{Path(__file__).resolve().parents[1]}/{GPT4}"
    result = eject_plan("dp=2,recompute=full,recompute_layers=1", spec)
    assert "RECOMPUTE_BLOCKS = (0,)" in result.code and not result.unsupported
    assert "selective recomputation" in "\n".join(eject_plan("dp=2,recompute=selective", spec).unsupported)
    assert not eject_plan("recompute=selective", LLAMA, _graph(LLAMA)).unsupported  # nothing to drop there
    path = tmp_path / "ejected.py"
    path.write_text(result.code)
    results = spawn(ejected_worker, 2, str(path))
    reference = reference_losses(str(path))  # plain, one process
    for losses in results:
        assert losses == pytest.approx(reference, rel=1e-5)
