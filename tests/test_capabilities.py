"""The closed loop between the solver and the backend: the capability table (`shardc.ops.lowering`).

1. Every candidate the enumeration offers for the GPT, Llama and BERT examples (`:tiny`) on
   2- and 4-device meshes (dp, cp, tp, tq) lowers: each is written into the graph, lowered and
   turned into every rank's module (no training), so a future mismatch between what the
   solver may choose and what codegen runs fails here, naming the candidate.
2. The backend refuses a partition the table refuses with the table's own message (issue 13:
   `q @ k^T` rotating its parallel key dim).
3. Every partition kind of the table and every plan key of `PLAN_KEYS` (read at run time) is
   trained by a multi-process numerics test against a one-process reference: `KIND_TESTS` and
   `KEY_TESTS` name the tests, and the test reads the plans each one runs from its source (the
   `(spec, plan[, edit])` cases, the `shardc.compile(..., plan=...)` calls), compiles them and
   checks the kind appears in the lowered graph, or the key in a plan.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from test_backend_numerics import build
from traced import traced

import shardc
from shardc.backends.torch.codegen import generate
from shardc.hardware import parse_cluster
from shardc.ir import Partition, TemporalSplit, TensorType
from shardc.ir.diagnostics import ShardcError
from shardc.ir.parser import parse
from shardc.ops.lowering import Site, all_kinds, kinds_of, refusal, resolution_kind
from shardc.ops.registry import get_op
from shardc.passes.lower import lower
from shardc.plan.parallel import PLAN_KEYS
from shardc.search.evaluate import Assignment
from shardc.search.planfile import annotate_graph
from shardc.search.problem import MeshShape, build_problem, graph_facts

TESTS = Path(__file__).resolve().parent
MODELS = ("examples/gpt.py:tiny", "examples/llama.py:tiny", "examples/bert.py:tiny")
# local2 and local4 meshes (priced on H100s: which candidates are offered does not depend on the device)
SHAPES = {"local2": (MeshShape(tp=2), MeshShape(cp=2)),
          "local4": (MeshShape(dp=2, tp=2), MeshShape(cp=2, tp=2), MeshShape(tp=2, tq=2))}


# ---- 1. every offered candidate lowers --------------------------------------------------------

def _lowering_failures(spec: str, shape: MeshShape) -> list[str]:
    """Round r writes candidate r of every group (the last one where a group has fewer), lowers
    a copy and generates rank 0's module (what codegen refuses does not depend on the rank);
    the failures, each naming the failing node's group and candidate."""
    graph = traced(spec)
    cluster = parse_cluster(f"{shape.devices}xH100")
    problem = build_problem(graph_facts(graph, cluster), cluster, shape, 2, 8)
    stages = ((len(problem.facts.layering.blocks), 0, 0),)
    failures = []
    for r in range(max(len(v.cands) for v in problem.groups)):
        choice = tuple(min(r, len(v.cands) - 1) for v in problem.groups)
        annotate_graph(graph, problem, Assignment(choice, stages, 0))
        copy = parse(str(graph))
        try:
            generate(lower(copy), 0)
        except (ShardcError, ValueError, KeyError, AssertionError) as err:
            failing = getattr(err, "node", None)
            names = {v.name for v in failing.outputs} if failing is not None else set()
            labels = [f"{v.group.name}: {v.cands[c].label}" for v, c in zip(problem.groups, choice)
                      if names & {o.name for n in v.group.members for o in n.outputs}] or ["?"]
            failures.append(f"{spec} on {shape}, round {r} ({'; '.join(labels)}): {str(err).splitlines()[0]}")
    return failures


@pytest.mark.parametrize("cluster", SHAPES)
@pytest.mark.parametrize("spec", MODELS)
def test_every_offered_candidate_lowers(spec: str, cluster: str) -> None:
    failures = [f for shape in SHAPES[cluster] for f in _lowering_failures(spec, shape)]
    assert failures == [], "\n".join(failures)


def test_backend_refuses_what_the_table_refuses_with_its_message() -> None:
    """Issue 13: GPT's `q @ k^T` (a matmul over (b, h, m, n, k)) rotating its key dim n, which
    is parallel: the table refuses it, the enumeration no longer offers it, codegen says why."""
    graph = traced("examples/gpt.py:tiny")
    cluster = parse_cluster("2xH100")
    problem = build_problem(graph_facts(graph, cluster), cluster, MeshShape(tp=2), 2, 8)
    scores = next(v for v in problem.groups if v.group.anchor.op == "matmul")
    labels = [c.label for c in scores.cands]
    assert "partition<tp:m>" in labels and not any("rotate" in label and "time n/" in label for label in labels)
    bad = Partition((("tp", "m"),), (TemporalSplit("n", 2, "tp"),))
    site = Site(scores.group.anchor.op, "contraction", scores.group.spaces[0], bad, problem.shape.mesh())
    assert refusal(site) == "a rotating split must cut a reduction dim; n is parallel"
    annotate_graph(graph, problem, Assignment(tuple(0 for _ in problem.groups),
                                              ((len(problem.facts.layering.blocks), 0, 0),), 0))
    scores.group.anchor.partition = bad
    copy = lower(parse(str(graph)))
    with pytest.raises(ShardcError, match="a rotating split must cut a reduction dim; n is parallel"):
        generate(copy, 0)


def test_refusals_of_the_table() -> None:
    graph = traced("examples/llama.py:tiny")
    cluster = parse_cluster("4xH100")
    problem = build_problem(graph_facts(graph, cluster), cluster, MeshShape(cp=2, tp=2), 2, 8)
    mesh = problem.shape.mesh()
    attn = next(v.group for v in problem.groups if v.group.anchor.op == "scaled_dot_product_attention")
    # the loss is the last member of the LM head's group (`build_groups`)
    loss = next(v.group for v in problem.groups if v.group.members[-1].op == "cross_entropy")

    def why(group: Any, partition: Partition) -> str | None:
        j = 0 if group is attn else -1
        return refusal(Site(group.members[j].op, "attention" if group is attn else "loss", group.spaces[j], partition,
                            mesh))

    assert why(attn, Partition((("cp", "s"),), (TemporalSplit("t", 2, "cp"),))) is None
    assert why(attn, Partition((("cp", "s"),), (TemporalSplit("t", 4, "cp"),))) == \
        "rotating split t/4 rotate cp needs steps == size of mesh axis cp (2)"
    assert why(attn, Partition((("cp", "t"),))) == \
        "t of scaled_dot_product_attention is split only in time, rotating (ring attention), not by mesh axis cp"
    assert why(attn, Partition((), (TemporalSplit("t", 2),))) == \
        "a temporal chunk of scaled_dot_product_attention cannot cut t (its ring rule)"
    assert why(loss, Partition((("cp", "v"), ("tp", "v")))) == \
        "cross entropy with classes split over more than one mesh axis"
    assert why(loss, Partition((), (TemporalSplit("d1", 2), TemporalSplit("d0", 2)))) == \
        "codegen runs one temporal split per node"
    assert why(loss, Partition((("tp", "v"),), (TemporalSplit("d0", 2),))) == (
        "a temporal chunk of cross_entropy with its classes split (vocab-parallel) is not lowered; keep the classes "
        "whole or the rows unchunked")
    amax = get_op("amax")
    space = amax.iteration_space([TensorType((4, 8), "f32")], [TensorType((4,), "f32")], {"dim": (1,)})
    assert refusal(Site("amax", amax.kind, space, Partition((("tp", "d1"),)), mesh)) == (
        "splitting amax's reduction d1 (mesh axis tp) leaves Partial(max), which the backend does not "
        "differentiate; keep d1 whole")
    assert refusal(Site("amax", amax.kind, space, Partition((("tp", "d0"),)), mesh)) is None


# ---- 3. every kind and plan key has a multi-process numerics test ----------------------------

@dataclasses.dataclass(frozen=True)
class Runs:
    """A multi-process numerics test: its file, its function (None: any test function of a file
    another engineer is adding), and a `key=value` one of its plans must set (else the key)."""

    file: str
    function: str | None = None
    sets: str = ""


BACKEND = "test_backend_numerics.py"
GPT_CASES = Runs(BACKEND, "test_gpt_plans_match_single_process")
LLAMA_CASES = Runs(BACKEND, "test_llama_and_transformers_gpt2_four_process_plans_match_single_process")
PIPELINES = Runs("test_pipeline_numerics.py", "test_pipelines_1f1b_gpipe_interleaved_and_accumulation_on_two_processes")
ZIGZAG = Runs("test_ring_numerics.py", "test_zigzag_context_parallel_two_processes_matches_one")
GRID = Runs("test_primepar2d.py", "test_mlps_on_a_2x2_grid_train_like_one_process")
MICRO = Runs("test_microbatch_numerics.py", "test_explicit_micro_batch_and_global_batch_accumulate_like_one_process")
PRECISION = Runs("test_precision.py", sets="dtype=bf16")                # mixed precision
RECOMPUTE = Runs("test_recompute.py", sets="recompute=selective")       # selective recomputation
COMPILED = Runs("test_compiled.py", "test_compiled_dp2_and_tp2_train_like_one_eager_process", sets="compile=1")
MOE = Runs("test_moe.py", "test_expert_parallel_training_matches_one_process_on_2_processes")

KIND_TESTS: dict[str, tuple[Runs, ...]] = {
    "spatial-dp": (GPT_CASES,),
    "spatial-cp": (GPT_CASES, LLAMA_CASES),
    "spatial-tp": (GPT_CASES,),
    "strided": (GPT_CASES,),                       # the fused qkv projection under tp
    "vocab-parallel-loss": (GPT_CASES,),
    "vocab-parallel-embedding": (GPT_CASES,),
    "one-temporal-split": (GPT_CASES,),
    "rotating-steps": (GPT_CASES, LLAMA_CASES),
    "ring-attention": (LLAMA_CASES,),
    "ring-attention-zigzag": (ZIGZAG,),
    "zigzag-shard": (ZIGZAG,),
    "rotating-contraction": (GPT_CASES,),
    "primepar-grid": (GRID,),
    "temporal-chunk": (GPT_CASES,),
    "partial-all-reduce": (GPT_CASES,),
    "partial-reduce-scatter": (GPT_CASES,),
    "expert-parallel": (MOE,),
}
ZERO_BUBBLE = tuple(Runs("test_zero_bubble.py", f"test_zero_bubble_schedules_on_{n}_processes", f"schedule={s}")
                    for s in ("zbv", "interleaved-zb", "dualpipev") for n in ("two", "four"))  # 2 and 4 ranks each
KEY_TESTS: dict[str, tuple[Runs, ...]] = {
    "dp": (GPT_CASES,), "tp": (GPT_CASES,), "pp": (PIPELINES,), "vpp": (PIPELINES,), "cp": (GPT_CASES, ZIGZAG),
    "sp": (GPT_CASES,), "mb": (MICRO,), "gbs": (MICRO,), "schedule": (dataclasses.replace(PIPELINES, sets="schedule=gpipe"),
                                                              *ZERO_BUBBLE),
    "recompute": (dataclasses.replace(GPT_CASES, sets="recompute=full"), RECOMPUTE),
    "recompute_layers": (dataclasses.replace(RECOMPUTE, sets="recompute_layers"),),
    "zero": (GPT_CASES,), "dtype": (PRECISION,), "compile": (COMPILED,), "ep": (MOE,),
}
MULTI_PROCESS = ("spawn", "spawn_jobs", "run_and_check", "_run")  # the harnesses that train on gloo processes


@dataclasses.dataclass(frozen=True)
class Case:
    spec: str
    plan: str
    edit: Any = None


def _function(runs: Runs) -> tuple[Any, list[ast.FunctionDef], dict[str, ast.FunctionDef]] | str:
    """The test module, the function(s) `runs` names and the module's other functions (fixtures
    among them, by name), or why they are missing."""
    path = TESTS / runs.file
    if not path.exists():
        return f"tests/{runs.file} is missing (the numerics test another engineer is adding has not landed)"
    tree = ast.parse(path.read_text())
    functions = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")
                 and (runs.function is None or f.name == runs.function)]
    if not functions:
        return f"tests/{runs.file} has no test function {runs.function or '(any)'}"
    others = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    return importlib.import_module(runs.file.removesuffix(".py")), functions, others


def _value(module: Any, node: ast.expr) -> Any:
    return eval(compile(ast.Expression(node), module.__file__, "eval"), vars(module))  # noqa: S307


def _cases(module: Any, function: ast.FunctionDef) -> list[Case]:
    """The plans `function` trains: `(spec, plan[, edit])` tuples in its body and in the module
    lists it names, and `shardc.compile(model, ..., plan=..., before_lower=...)` calls (the spec
    from the `build(spec)` before them)."""
    out: list[Case] = []
    spec = None
    nodes = list(ast.walk(function))
    for name in [n.id for n in nodes if isinstance(n, ast.Name) and isinstance(getattr(module, n.id, None), list)]:
        out += [Case(*_case(module, item)) for item in getattr(module, name) if _case(module, item)]
    for node in sorted((n for n in nodes if isinstance(n, (ast.Tuple, ast.Call, ast.List))), key=lambda n: (n.lineno, n.col_offset)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "build" and node.args:
            try:
                spec = _value(module, node.args[0])
            except NameError:  # build(spec) in a loop over the cases: they are read as tuples
                spec = None
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "compile":
            kw = {k.arg: k.value for k in node.keywords}
            if "plan" in kw and spec is not None and isinstance(kw["plan"], ast.Constant):
                edit = _value(module, kw["before_lower"]) if "before_lower" in kw else None
                out.append(Case(spec, kw["plan"].value, edit))
        elif isinstance(node, ast.List) and hasattr(module, "SPEC") and node.elts and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) and "=" in e.value for e in node.elts):
            out += [Case(module.SPEC, e.value) for e in node.elts]  # a list of plans for the module's model
        elif isinstance(node, ast.Tuple) and len(node.elts) >= 2:
            try:
                item = tuple(_value(module, e) for e in node.elts)
            except Exception:  # noqa: BLE001 - a tuple of locals, not a case
                continue
            found = _case(module, item)
            if found:
                out.append(Case(*found))
    return out


def _case(module: Any, item: Any) -> tuple[str, str, Any] | None:
    if not (isinstance(item, tuple) and len(item) >= 2 and isinstance(item[0], str) and isinstance(item[1], str)
            and "=" in item[1] and (item[0].startswith(("examples/", "hf:")) or item[0].endswith(".onnx"))):
        return None
    edit = item[2] if len(item) > 2 else None
    if isinstance(edit, str):
        edit = getattr(module, "EDITS", {}).get(edit)
    return item[0], item[1], edit if callable(edit) else None


def _plan_keys(plan: str) -> dict[str, str]:
    return dict(kv.split("=", 1) if "=" in kv else (kv, "") for kv in plan.split(","))


@cache
def _compiled_kinds(case: Case) -> frozenset[str]:
    """The partition kinds the lowered graph of `case` uses."""
    model, inputs, names = build(case.spec)
    graph = shardc.compile(model, inputs, plan=case.plan, input_names=names, before_lower=case.edit).graph
    assert graph.mesh is not None
    kinds = set()
    for node in graph.nodes:
        site = Site.of(node, graph.mesh)
        kinds.update(kinds_of(site) if site is not None else [])
        found = resolution_kind(node)
        if found:
            kinds.add(found)
    return frozenset(kinds)


def _check(runs: Runs, kind: str | None, key: str | None) -> str | None:
    """None when `runs` trains multi-process and one of its plans uses `kind` / sets `key`."""
    found = _function(runs)
    if isinstance(found, str):
        return found
    module, functions, others = found
    for function in functions:
        # multi-process: the test calls a harness, or takes a module fixture that does (several
        # tests' plans trained in one shared launch, `tests/shared_spawn.py`) and checks its results
        sources = [ast.unparse(function)] + [ast.unparse(others[a.arg]) for a in function.args.args if a.arg in others]
        if not any(f"{h}(" in source for source in sources for h in MULTI_PROCESS):
            continue
        cases = _cases(module, function)
        if key is not None:
            want = runs.sets or key
            name, _, value = want.partition("=")
            if any(name in _plan_keys(c.plan) and (not value or _plan_keys(c.plan)[name] == value) for c in cases):
                return None
        if kind is not None and any(kind in _compiled_kinds(c) for c in cases):
            return None
    what = f"partition kind {kind}" if kind else f"plan key {runs.sets or key}"
    return f"{runs.file}::{runs.function or '*'} runs no multi-process plan with {what}"


def test_the_coverage_tables_name_every_kind_and_key() -> None:
    assert set(KIND_TESTS) == set(all_kinds()), "a partition kind of shardc.ops.lowering has no entry in KIND_TESTS"
    assert len(set(all_kinds())) == len(all_kinds()), "two capability entries share a kind name"
    missing = [k for k in PLAN_KEYS if k not in KEY_TESTS]
    assert missing == [], f"plan keys without a multi-process numerics test in KEY_TESTS: {missing}"


def test_every_partition_kind_is_trained_multi_process() -> None:
    failures = [f"{kind}: {why}" for kind, tests in KIND_TESTS.items() for runs in tests
                if (why := _check(runs, kind, None)) is not None]
    assert failures == [], "\n".join(failures)


def test_every_plan_key_is_trained_multi_process() -> None:
    """Every key of `PLAN_KEYS` is set by a plan some multi-process numerics test trains."""
    failures = []
    for key in PLAN_KEYS:
        if key not in KEY_TESTS:
            failures.append(f"{key}: no multi-process numerics test (the torch backend does not run it)")
            continue
        failures += [f"{key}: {why}" for runs in KEY_TESTS[key] if (why := _check(runs, None, key)) is not None]
    assert failures == [], "\n".join(failures)
