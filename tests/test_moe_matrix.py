"""Issue 15's numerics matrix: mixtral, qwen3_moe and deepseek_v3 under ep=2 (2 processes), ep x dp,
ep x tp and ep x pp (4 processes), through `shardc run` and through `shardc.compile` in a user's
own loop, against one process at 1e-5 (fp32); and ep under the other pipeline schedules and with
context parallelism.

Two paths, every plan of a path and process count in one launch (ep=2 alone in the user's loop:
`test_moe`'s 2-process launch; mixtral's ep=2 through the command line: `test_moe`):
- the user's loop (`shardc.compile(model, inputs, plan=...)`, `plan.parallelize(model)`, AdamW;
  `module(*batch)` then `loss.backward()`, or `module.step(*batch)` when the plan pipelines),
  losses and every weight after 3 steps against the model trained by transformers itself in one
  process (`test_backend_numerics.check`: the model with its next-token loss, AdamW eps 1e-4);
- `shardc run` (`shardc.run.launch_all`, what `shardc run MODEL --nproc N --plan P` launches:
  torchrun workers training in `shardc.train`'s loop), its losses against transformers' model in
  one process on the same synthetic data (`test_moe.transformers_losses`).
`test_the_matrix_is_complete` reads every MoE test's plans (here and in `test_moe.py`,
`test_moe_compose.py`) and fails when a model, composition and path issue 15 names has none.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_backend_numerics import EPS, LR, batches, build, check
from test_moe import DEEPSEEK_V3, MIXTRAL, QWEN3_MOE, transformers_losses

from shardc.backends.torch.launch import spawn

TESTS = Path(__file__).resolve().parent
MODELS = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}


def layers(spec: str, n: int, batch: int | None = None) -> str:
    """`spec` with `n` decoder layers (deepseek_v3: the first stays dense), and `batch` sequences."""
    out = spec.replace("num_hidden_layers=1&", f"num_hidden_layers={n}&").replace(
        "num_hidden_layers=2&", f"num_hidden_layers={n}&")
    return out.replace("batch=4", f"batch={batch}") if batch else out


# ---- the user's own loop ----------------------------------------------------------------------

def experts_split(*forms: str) -> Callable[[Any], None]:
    """A `before_lower` edit: the model's `experts` ops, in order, partitioned as `forms` say
    (`"ep:t,tp:i"`: mesh axis -> iteration dim, `shardc.ops.moe`): the partitions the solver may
    choose beside the one apply-plan writes (`test_moe_offers`); the expert weights held as the
    new partition reads them, the output's partial sum (tp:i) all-reduced where it is made."""

    def edit(graph: Any) -> None:
        from shardc.analysis.propagate import io_layouts
        from shardc.ir import Layout, Partial, Partition

        experts = [n for n in graph.nodes if n.op == "experts"]
        assert len(experts) == len(forms), f"{len(experts)} experts ops for the forms {forms}"
        for node, form in zip(experts, forms):
            spatial = tuple(tuple(pair.split(":")) for pair in form.split(","))
            strides = tuple((a, k) for a, k in node.partition.strides if (a, "i") in spatial)  # gate/up rows
            node.partition = Partition(spatial, (), strides)  # type: ignore[arg-type]
            for weight in node.inputs[3:]:
                weight.layout = None
            made = io_layouts(node, graph.mesh)[1][0]
            node.outputs[0].layout = Layout(tuple((a, p) for a, p in made.placements if not isinstance(p, Partial)))

    edit.__name__ = f"experts_split{forms}"
    edit.forms = forms  # type: ignore[attr-defined]  # read by `test_moe_offers`
    return edit


# transformers' own loss (labels) plus the load-balancing aux loss over every layer's router logits,
# weighted 0.5 (not 0.001) so that a wrong aux gradient shows at 1e-5
OWN_LOSS = "&labels=true&output_router_logits=true&router_aux_loss_coef=0.5"


def build_case(spec: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], tuple[str, ...]]:
    """`test_backend_numerics.build`, except that a spec with `OWN_LOSS` keeps transformers' model
    as it is: `model(input_ids, labels)` returns its loss (with the aux term), the aux loss, the
    logits and the router logits, the graph's outputs."""
    if OWN_LOSS not in spec:
        return build(spec)
    from shardc.frontend.spec import load_model

    torch.manual_seed(0)
    loaded = load_model(spec, device="cpu")
    return loaded.model, tuple(loaded.example_inputs), tuple(loaded.input_names)


def microbatch_rows(batch: int, plan: str) -> list[list[int]]:
    """The rows of each of the plan's micro-batches over the whole group: data rank r (dp x ep)
    holds rows r*batch/ranks onwards and runs them mb/ep at a time, and micro-batch j joins every
    rank's j-th piece (`shardc.backends.torch.microbatch`). The aux loss, not a mean over tokens,
    is the model's on each such micro-batch, as with gradient accumulation in one process."""
    keys = {k: int(v) for k, v in (kv.split("=") for kv in plan.split(",")) if v.isdigit()}
    ranks, per = keys.get("dp", 1) * keys.get("ep", 1), keys["mb"] // keys.get("ep", 1)
    share = batch // ranks
    return [[r * share + j * per + i for r in range(ranks) for i in range(per)] for j in range(share // per)]


@functools.cache
def own_loss_reference(spec: str, rows: tuple[tuple[int, ...], ...]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """transformers' model trained in one process on `test_backend_numerics.batches`: each step the
    mean of its own loss over the micro-batches `rows`, AdamW as there."""
    torch.use_deterministic_algorithms(True)
    model, inputs, _ = build_case(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for ids, labels in batches(inputs):
        loss = sum(model(input_ids=ids[list(r)], labels=labels[list(r)]).loss for r in rows) / len(rows)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def check_case(spec: str, plan: str, losses: list[float], full: dict[str, torch.Tensor]) -> None:
    """`test_backend_numerics.check`, or for `OWN_LOSS` specs against `own_loss_reference`."""
    if OWN_LOSS not in spec:
        return check(spec, plan, losses, full)
    batch = int(spec.split("batch=")[1].split("&")[0])
    ref_losses, ref_state = own_loss_reference(spec, tuple(map(tuple, microbatch_rows(batch, plan.split(" ")[0]))))
    assert losses == pytest.approx(ref_losses, rel=1e-5), f"{spec} {plan}: losses {losses} vs {ref_losses}"
    for name, want in ref_state.items():
        torch.testing.assert_close(full[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{spec} {plan} {n}: {m}")


# ep=2 alone (2 processes) trains in `test_moe.test_expert_parallel_training_...`. Every 4-process
# plan of the MoE tests, in one launch: each model under ep x dp, ep x tp and ep x pp (mixtral's and
# deepseek_v3's other compositions go through `shardc run` below), the ZeRO stages and recomputations
# the search sets beside ep, and ep under every pipeline schedule and with context parallelism.
LOOP_FOUR = [
    (DEEPSEEK_V3, "ep=2,tp=2,mb=4"),                        # MLA heads, dense first layer, shared experts on tp
    (QWEN3_MOE, "ep=2,tp=2,sp=1,mb=4"),                     # the experts' tokens gathered over tp, output scattered
    (QWEN3_MOE, "dp=2,ep=2,zero=1,mb=2"),                   # FSDP2 over dp: dense gradients summed over ep first
    (MIXTRAL, "dp=2,ep=2,zero=2,recompute=selective,mb=2"),
    (DEEPSEEK_V3, "dp=2,ep=2,zero=3,recompute=full,recompute_layers=1,mb=2"),  # the dense block recomputed
    (layers(QWEN3_MOE, 2), "ep=2,pp=2,mb=2"),               # 1F1B
    (layers(MIXTRAL, 4), "ep=2,pp=2,vpp=2,mb=2"),           # interleaved 1F1B
    (layers(MIXTRAL, 4), "ep=2,pp=2,vpp=2,schedule=zbv,mb=2"),
    (layers(MIXTRAL, 4), "ep=2,pp=2,vpp=2,schedule=interleaved-zb,mb=2"),
    (layers(MIXTRAL, 4, batch=8), "ep=2,pp=2,vpp=2,schedule=dualpipev,mb=2"),  # 4 micro-batches: 2*pp
    (MIXTRAL, "ep=2,cp=2,mb=4"),                            # the sequence over cp, the experts' tokens with it
    # the solver's other partitions of the experts (`test_moe_offers`): tokens over ep or tp
    (layers(MIXTRAL, 2), "ep=2,tp=2,mb=4", experts_split("ep:t,tp:i", "ep:e,tp:t")),
    (MIXTRAL, "ep=2,tp=2,mb=4", experts_split("ep:t,tp:t")),
    (layers(MIXTRAL, 2), "dp=2,ep=2,mb=2", experts_split("dp:t,ep:t", "dp:t,ep:e")),
    # the model's own loss with the routers' aux loss: router logits made on stage 0, the loss on stage 1
    (layers(MIXTRAL, 2) + OWN_LOSS, "ep=2,pp=2,mb=2"),
    (layers(MIXTRAL, 2) + OWN_LOSS, "dp=2,ep=2,mb=2"),
]


def train_cases(rank: int, world: int, cases: list[tuple[str, Any]]) -> list[tuple[list[float], dict] | str]:
    """On every rank, each compiled plan in a user's loop: `module(*batch)` and `loss.backward()`,
    or `module.step(*batch)` (forward and backward over the schedule) when the plan pipelines;
    AdamW as `test_backend_numerics`. A case that fails returns its error's message."""
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    out: list[tuple[list[float], dict] | str] = []
    for spec, compiled in cases:
        model, inputs, _ = build_case(spec)
        try:
            module = compiled.parallelize(model)
            pipelined = compiled.plan.pp > 1
            opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
            losses = []
            for batch in batches(inputs):
                if pipelined:
                    loss = module.step(*batch)
                else:
                    loss = module(*batch)
                    loss = loss[0] if isinstance(loss, tuple | list) else loss  # the model's own outputs
                    loss.backward()
                opt.step()
                opt.zero_grad()
                value = loss.detach().clone()
                dist.all_reduce(value)  # every rank's loss is its share's mean (pipeline ranks: the whole)
                losses.append(float(value) / world)
            full = compiled.full_state_dict(module)
        except Exception as err:  # noqa: BLE001 - reported per case, the others still run
            out.append(f"{type(err).__name__}: {err}")
            continue
        out.append((losses, {k: v.clone() for k, v in full.items()} if rank == 0 else {}))
    return out


def loop_and_check(world: int, cases: list[tuple[Any, ...]]) -> list[str]:
    """Compile every (spec, plan[, before_lower edit]) case (fp32), train all in one launch of
    `world` processes, compare each with one process; the failures, each naming its case."""
    import shardc

    compiled = []
    for spec, plan, *edit in cases:
        model, inputs, names = build_case(spec)
        compiled.append((spec, shardc.compile(model, inputs, plan=f"{plan},dtype=fp32", input_names=names,
                                              before_lower=edit[0] if edit else None)))
    results = spawn(train_cases, world, compiled, timeout_s=600)
    failures = []
    for (spec, plan, *edit), result in zip(cases, results[0]):
        plan += f" +{edit[0].__name__}" if edit else ""
        if isinstance(result, str):
            failures.append(f"{spec} {plan}: {result}")
            continue
        try:
            check_case(spec, plan, *result)
        except AssertionError as err:
            failures.append(str(err).splitlines()[0])
    return failures


def test_expert_parallel_compositions_in_a_users_loop_match_one_process_on_4_processes() -> None:
    assert loop_and_check(4, LOOP_FOUR) == []


# ---- shardc run -------------------------------------------------------------------------------

RUN_STEPS, RUN_SEED = 3, 3
# mixtral under ep=2 goes through the command line itself in `test_moe.test_shardc_run_trains_mixtral_...`
RUN_TWO = [(QWEN3_MOE, "ep=2,mb=4"), (DEEPSEEK_V3, "ep=2,mb=4")]
RUN_FOUR = [(MIXTRAL, "ep=2,tp=2,mb=4"), (QWEN3_MOE, "dp=2,ep=2,mb=2"), (DEEPSEEK_V3, "ep=2,pp=2,mb=2"),
            # mixtral's experts (intermediate 128) dominate the backward's working memory: its peak
            # was +6.4% (dp x ep) and +9.9% (ep x pp) over the prediction before the experts' weight
            # gradients were priced as the backend holds them (`cost.moe.weight_gradient_copies`)
            (MIXTRAL, "dp=2,ep=2,mb=2"), (layers(MIXTRAL, 2), "ep=2,pp=2,mb=2")]


def run_and_compare(nproc: int, cases: list[tuple[str, str]], tmp: Path) -> list[str]:
    """Every case through `shardc run`'s launcher in one torchrun (fp32); each case's losses
    against transformers' model in one process on the same data, and each rank's measured peak
    memory (`shardc run`'s tracked step) within 5% of the cost model's prediction for it (as
    `test_memory_accuracy` holds dense plans; on a fixed `local` profile): the failures."""
    from test_hardware import fixed_local_profile

    from shardc.run import launch_all, predict, resolve_plan, summarize

    runs = [(spec, resolve_plan(f"{plan},dtype=fp32", nproc)) for spec, plan in cases]
    reports = launch_all(runs, nproc=nproc, steps=RUN_STEPS, seed=RUN_SEED, timeout_s=600)
    failures = []
    for (spec, plan), per_rank in zip(cases, reports):
        got, want = per_rank[0]["losses"], transformers_losses(spec, RUN_STEPS, RUN_SEED)
        if got != pytest.approx(want, rel=1e-5):
            failures.append(f"{spec} {plan}: losses {got} vs one process {want}")
    with fixed_local_profile(tmp):
        for (spec, plan), run, per_rank in zip(cases, runs, reports):
            summary = summarize(spec, run[1], per_rank, *predict(spec, run[1], None, nproc))
            for r in summary["ranks"]:
                measured, predicted = r["peak_memory_bytes"], r["predicted_peak_memory_bytes"]
                if predicted is None or measured != pytest.approx(predicted, rel=0.05):
                    failures.append(f"{spec.split('?')[0]} {plan} rank {r['rank']}: peak memory measured "
                                    f"{measured:,} B, predicted {predicted} ({summary['prediction']})")
    return failures


def test_shardc_run_trains_every_model_expert_parallel_like_one_process_on_2_processes(tmp_path: Path) -> None:
    assert run_and_compare(2, RUN_TWO, tmp_path) == []


def test_shardc_run_trains_ep_with_dp_tp_and_pp_like_one_process_on_4_processes(tmp_path: Path) -> None:
    assert run_and_compare(4, RUN_FOUR, tmp_path) == []


# ---- the matrix -------------------------------------------------------------------------------

COMPOSITIONS = ("ep", "ep x dp", "ep x tp", "ep x pp")
# The harness calls that make a test function's plans train by each path.
PATHS = {"shardc run": ("run_and_compare(", "launch_all(", "main(['run'"),
         "shardc.compile": ("loop_and_check(", "run_and_check(", "run_pipelines(")}
FILES = ("test_moe.py", "test_moe_compose.py", "test_moe_matrix.py")


def composition(plan: str) -> str | None:
    """The matrix column of an expert-parallel plan (None: no ep, or not one of the four)."""
    keys = dict(kv.split("=", 1) for kv in plan.split(",") if "=" in kv)
    if int(keys.get("ep", "1")) <= 1:
        return None
    others = [k for k in ("dp", "tp", "pp") if int(keys.get(k, "1")) > 1]
    if int(keys.get("cp", "1")) > 1 or len(others) > 1:
        return None
    return f"ep x {others[0]}" if others else "ep"


# A trained case as the coverage tests read it: spec, plan, and the experts' forms its edit writes.
Case = tuple[str, str, tuple[str, ...] | None]


def _strings(tree: ast.AST, module: dict[str, Any]) -> list[Case]:
    """The cases a test function trains: tuples of two evaluable strings (an `hf:` spec and a
    plan, then maybe an `experts_split` edit) in its body and in the module lists it names, each
    once; and the spec and plan of a `main(["run", ...])` command line."""
    out: list[Case] = []
    for node in ast.walk(tree):
        items: list[Any] = []
        if isinstance(node, ast.Name) and isinstance(module.get(node.id), list):
            items = module[node.id]
        elif isinstance(node, ast.Tuple):
            items = [_evaluated(node, module)]
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "main" and node.args \
                and isinstance(node.args[0], ast.List):  # the command line: main(["run", SPEC, ..., "--plan", PLAN])
            words = [_evaluated(e, module) for e in node.args[0].elts]
            if words[:1] == ["run"] and "--plan" in words:
                items = [(words[1], words[words.index("--plan") + 1])]  # type: ignore[list-item]
        for item in items:
            if isinstance(item, tuple) and len(item) >= 2 and all(isinstance(x, str) for x in item[:2]) \
                    and item[0].startswith("hf:"):
                case = (item[0], item[1], getattr(item[2], "forms", None) if len(item) > 2 else None)
                out += [case] if case not in out else []
    return out


def _evaluated(node: ast.expr, module: dict[str, Any]) -> Any:
    """The value of an expression of the test's module (None where it reads the test's locals)."""
    try:
        return eval(compile(ast.Expression(node), "<case>", "eval"), module)  # noqa: S307
    except Exception:  # noqa: BLE001 - names local to the test, not a case
        return None


def cases_by_test() -> dict[str, list[Case]]:
    """`file::function` -> the (spec, plan) cases it trains, for every test function of `FILES`
    that trains multi-process (calls a harness of `PATHS`)."""
    return {test: cases for test, (_, cases) in _scanned().items()}


def _scanned() -> dict[str, tuple[list[str], list[Case]]]:
    """`file::function` -> (the paths it trains by, its (spec, plan) cases)."""
    import importlib

    out = {}
    for file in FILES:
        module = vars(importlib.import_module(file.removesuffix(".py")))
        for function in ast.parse((TESTS / file).read_text()).body:
            if not (isinstance(function, ast.FunctionDef) and function.name.startswith("test")):
                continue
            text = ast.unparse(function)
            paths = [p for p, calls in PATHS.items() if any(c in text for c in calls)]
            if paths:
                out[f"{file}::{function.name}"] = (paths, _strings(function, module))
    return out


def covered() -> dict[tuple[str, str, str], list[str]]:
    """(model, composition, path) -> the tests that train it multi-process."""
    out: dict[tuple[str, str, str], list[str]] = {}
    for test, (paths, cases) in _scanned().items():
        for spec, plan, _ in cases:
            model = next((m for m, s in MODELS.items() if spec.split("?")[0] == s.split("?")[0]), None)
            column = composition(plan)
            for path in paths if model and column else []:
                tests = out.setdefault((model, column, path), [])
                tests += [test] if test not in tests else []
    return out


def test_the_matrix_is_complete() -> None:
    """Every model under every composition through one path at least; every composition through
    both paths (one model at least); ep=2 alone for all three models through both."""
    have = covered()
    missing = [f"{m} {c}" for m in MODELS for c in COMPOSITIONS if not any((m, c, p) in have for p in PATHS)]
    missing += [f"{c} through {p}" for c in COMPOSITIONS for p in PATHS if not any((m, c, p) in have for m in MODELS)]
    missing += [f"{m} ep through {p}" for m in MODELS for p in PATHS if (m, "ep", p) not in have]
    assert missing == [], f"issue 15's matrix lacks: {missing}"


def test_the_routers_logits_made_on_stage_0_are_outputs_of_the_last_stage_under_ep_x_pp() -> None:
    """transformers' MixtralForCausalLM with labels and output_router_logits returns its loss (with
    the load-balancing aux term), the aux loss, the logits and every layer's router logits. Under
    ep x pp layer 0's logits are made on stage 0: a pipeline returns its last stage's outputs, so
    they are sent there (one send, shared with the aux loss's reader there) and gathered over ep
    after the last node. That this trains like one process: `LOOP_FOUR`'s OWN_LOSS cases."""
    import shardc
    from shardc.analysis.resharding import node_stage
    from shardc.backends.torch.stages import split_stages

    compiled = shardc.compile(layers(MIXTRAL, 2) + OWN_LOSS, plan="ep=2,pp=2,mb=2,dtype=fp32", device="meta")
    graph = compiled.graph
    router = next(n for n in graph.nodes if n.op == "linear" and n.location.module_path == "model.layers.0.mlp.gate")
    sends = [n for n in graph.nodes if n.op == "send" and n.inputs[0] is router.outputs[0]]
    assert len(sends) == 1, [str(n) for n in sends]
    out = graph.outputs[-2]  # layer 0's router logits, gathered over ep
    assert out.producer is not None and out.producer.op == "all_gather"
    assert node_stage(graph, out.producer) == 1 and out.producer.inputs[0].producer.op == "recv"
    assert split_stages(graph).stages[1].outputs == graph.outputs
