"""What the search offers with expert parallelism, and the numerics tests behind each offer.

1. Every combination of ep with another axis or pipeline schedule is either trained like one
   process by a multi-process numerics case of the MoE tests and offered by the search
   (`shardc.search.outer.mesh_shapes`, `shardc.search.schedules.schedule_shapes`), or refused by
   the plan with a message naming the combination, and then never offered.
2. Issue 13's capability rule extended to ep: every plan key the search sets beside ep > 1
   (degrees, schedule, ZeRO stage, recomputation, sequence parallelism) and every partition of the
   `experts` op it offers on a mesh with ep has a multi-process numerics case with ep > 1 in
   `tests/test_moe*.py` (read from their source as `test_moe_matrix.covered` reads them). The
   partitions of the other ops are the dense table's (`test_capabilities`): ep is a batch axis
   for them, as `test_moe_search` checks.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from test_moe import MIXTRAL
from test_moe_matrix import FILES, cases_by_test

from shardc.ir import RECOMPUTE_CHOICES, ZERO_STAGES
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan
from shardc.search.outer import LONG_SEQUENCE, MAX_VPP, mesh_shapes
from shardc.search.problem import MeshShape
from shardc.search.schedules import schedule_shapes

# name -> a 4-device plan with the combination (mb where the combination needs it)
COMBINATIONS = {
    "ep x dp": "dp=2,ep=2",
    "ep x tp": "ep=2,tp=2",
    "ep x cp": "ep=2,cp=2",
    "ep x pp under 1F1B": "ep=2,pp=2",
    "ep x pp under interleaved 1F1B": "ep=2,pp=2,vpp=2",
    "ep x pp under zbv": "ep=2,pp=2,vpp=2,schedule=zbv",
    "ep x pp under interleaved-zb": "ep=2,pp=2,vpp=2,schedule=interleaved-zb",
    "ep x pp under dualpipev": "ep=2,pp=2,vpp=2,schedule=dualpipev",
}
# name -> the message a plan with it is refused with: none today, every combination trains. (The
# search offers no tp x tq grid with ep, `mesh_shapes`: a grid is no plan key, only a plan file's.)
REFUSED: dict[str, str] = {}
DEGREES = ("dp", "tp", "pp", "vpp", "cp", "ep")


def _keys(plan: str | ParallelPlan) -> dict[str, str]:
    """A plan's keys as the coverage compares them: degrees as whether they are > 1, the rest as set."""
    parsed = ParallelPlan.parse(plan) if isinstance(plan, str) else plan
    out = {k: v for k, v in parsed.items()}
    for k in DEGREES:
        out[k] = ">1" if int(out.get(k, "1")) > 1 else "1"
    return out


def _searched_shapes(devices: int, layers: int, seq: int) -> list[MeshShape]:
    shapes = mesh_shapes(devices, 8, layers, 16, seq, grid2d=True, experts=8)
    return shapes + schedule_shapes(shapes, layers, MAX_VPP)


def offered(plan: str) -> bool:
    """Whether the search offers `plan`'s mesh shape (degrees, vpp, schedule) for an MoE model
    with 8 experts and 4 blocks on 4 devices (a long sequence where the plan splits it)."""
    parsed = ParallelPlan.parse(plan)
    want = MeshShape.of(parsed)
    seq = LONG_SEQUENCE if parsed.cp > 1 else 16
    return want in _searched_shapes(parsed.devices, 4, seq)


def _trained_with_ep() -> list[tuple[str, dict[str, str]]]:
    """(test, plan keys) of every expert-parallel plan the MoE tests train multi-process."""
    return [(test, _keys(plan)) for test, cases in cases_by_test().items() for _, plan, _ in cases
            if ParallelPlan.parse(plan).ep > 1]


def _trains(want: dict[str, str], trained: list[tuple[str, dict[str, str]]]) -> list[str]:
    return [test for test, keys in trained if all(keys.get(k) == v for k, v in want.items())]


def test_every_combination_of_ep_trains_and_is_offered_or_is_refused_and_never_offered() -> None:
    trained = _trained_with_ep()
    failures = []
    for name, plan in COMBINATIONS.items():
        want = {k: v for k, v in _keys(plan).items() if k in (*DEGREES, "schedule")}
        if name in REFUSED:
            with pytest.raises(ShardcError, match=REFUSED[name]):
                ParallelPlan.parse(plan)
            if offered(plan):
                failures.append(f"{name}: refused, yet the search offers it")
            continue
        if not _trains(want, trained):
            failures.append(f"{name}: no multi-process numerics case in {', '.join(FILES)} trains {plan}")
        if not offered(plan):
            failures.append(f"{name}: trains like one process, yet the search does not offer it")
    assert failures == [], "\n".join(failures)


def searched_keys_beside_ep() -> set[tuple[str, str]]:
    """(key, value) pairs the search sets in a plan with ep > 1, on 4 and 8 devices: degrees
    (as > 1) and schedules from its mesh shapes, ZeRO stages where there is a data group to shard
    over (the solver's `ZERO_STAGES`), every recomputation, partial recomputation (the grid's
    `recompute_layers`), sequence parallelism with tp (the grid's layouts)."""
    out: set[tuple[str, str]] = set()
    for devices in (4, 8):
        for seq in (16, LONG_SEQUENCE):
            for s in _searched_shapes(devices, 4, seq):
                if s.ep <= 1:
                    continue
                plan = s.plan(s.ep * 2, 16)
                out |= {(k, v) for k, v in _keys(plan).items() if k in DEGREES and v == ">1" and k != "ep"}
                out.add(("schedule", plan.schedule))
                if s.tq > 1:
                    out.add(("tq", ">1"))
                if s.dp > 1:
                    out |= {("zero", str(z)) for z in ZERO_STAGES[1:]}
                if s.tp > 1:
                    out.add(("sp", "1"))
    out |= {("recompute", r) for r in RECOMPUTE_CHOICES[1:]} | {("recompute_layers", ">0")}
    return out


def test_every_key_the_search_sets_beside_ep_is_trained_with_ep() -> None:
    trained = _trained_with_ep()
    missing = []
    for key, value in sorted(searched_keys_beside_ep()):
        if key == "recompute_layers":
            hit = [t for t, keys in trained if keys.get(key) not in (None, "", "None")]
        else:
            hit = _trains({key: value}, trained)
        if not hit:
            missing.append(f"{key}={value}")
    assert missing == [], f"the search sets these beside ep>1, but no MoE numerics test trains them with ep: {missing}"


def _form(spatial: tuple[tuple[str, str], ...]) -> str:
    """An experts partition as the coverage compares it: `axis:dim` pairs in mesh order, dp left
    out (dp always splits the tokens: the data-parallel path every form shares)."""
    return ",".join(f"{a}:{d}" for a, d in spatial if a != "dp")


@cache
def _mixtral() -> Any:
    from shardc.driver import load, solver_batch

    return load(MIXTRAL.replace("batch=4", "batch=8"), batch=solver_batch(8))


@cache
def _traced_mixtral() -> Any:
    """The mixtral traced on the meta device with 8 sequences, its layers grouped (as `traced`)."""
    from shardc.frontend import trace
    from shardc.frontend.spec import load_model
    from shardc.passes.group_layers import group_layers

    loaded = load_model(MIXTRAL.replace("batch=4", "batch=8"), device="meta")
    return group_layers(trace(loaded.model, loaded.example_inputs, name=loaded.name, input_names=loaded.input_names))


def experts_forms_offered() -> dict[str, str]:
    """Form -> a shape the search offers it on: every partition of the `experts` op of a mixtral
    the candidates hold on the intra-stage meshes (pp left out) of the 4-device shapes with ep >
    1, a long sequence included (cp)."""
    from shardc.hardware import parse_cluster
    from shardc.search.problem import build_problem, graph_facts

    cluster = parse_cluster("4xH100")
    facts = graph_facts(_mixtral(), cluster, "fp32")
    shapes = {MeshShape(1, s.dp, s.cp, s.tp, s.tq, ep=s.ep) for seq in (16, LONG_SEQUENCE)
              for s in _searched_shapes(4, 1, seq) if s.ep > 1}
    out: dict[str, str] = {}
    for shape in sorted(shapes, key=str):
        problem = build_problem(facts, cluster, shape, 2 * shape.ep, 8, "fp32")
        for var in problem.groups:
            if var.group.anchor.op == "experts":
                for cand in var.cands:
                    part = cand.partitions[0]
                    assert part is not None and not part.temporal, f"{shape}: experts {part}: a temporal split"
                    out.setdefault(_form(part.spatial), str(shape))
    return out


def experts_forms_trained() -> dict[str, str]:
    """Form -> a test that trains it multi-process: the form an `experts_split` edit writes, else
    the one apply-plan gives the plan (written on a mixtral, its pipeline left out: the experts'
    partition does not depend on it)."""
    import dataclasses

    from shardc.ir.parser import parse
    from shardc.passes.apply_plan import apply_plan

    out: dict[str, str] = {}
    applied: dict[str, str] = {}
    for test, cases in cases_by_test().items():
        for _, plan, forms in cases:
            parsed = ParallelPlan.parse(plan)
            if parsed.ep <= 1:
                continue
            if forms is not None:
                for form in forms:
                    out.setdefault(_form(tuple(tuple(p.split(":")) for p in form.split(","))), test)  # type: ignore[arg-type]
                continue
            flat = dataclasses.replace(parsed, pp=1, vpp=1, schedule="1f1b", gbs=None, mb=8 // parsed.dp,
                                       recompute_layers=None)
            if str(flat) not in applied:
                graph = apply_plan(parse(str(_traced_mixtral())), flat)
                experts = next(n for n in graph.nodes if n.op == "experts")
                applied[str(flat)] = _form(experts.partition.spatial)
            out.setdefault(applied[str(flat)], test)
    return out


def test_every_experts_partition_the_search_offers_is_trained_with_ep() -> None:
    trained = experts_forms_trained()
    missing = [f"{form} (offered on {shape})" for form, shape in sorted(experts_forms_offered().items())
               if form not in trained]
    assert missing == [], f"experts partitions the search offers that no MoE numerics test trains: {missing}"
