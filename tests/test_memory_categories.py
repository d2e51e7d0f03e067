"""Memory per category, measured while training, against the cost model's prediction (issue 14:
every rank within 5% in total and 10% in each category, not only in total).

One torchrun of four gloo processes trains the study's model (`shardc study`'s default) under
plans that each exercise a runtime's own buffers (`shardc.run.launch_all`: one warm-up step,
one timed, then the memory-tracked step under `shardc.train.memory`); the prediction is `shardc
run`'s (`shardc.run.predict`, the stage's memory by category), compared category by category
as the study compares them (`shardc.study.compare.category_errors`: working = the tracker's
`other` and model buffers against the estimate's working, recompute_working and model buffers;
a category under 2% of the rank's peak on both sides is not compared):

- sequence parallelism: the all-gathers into the column-parallel linears and the reduce-
  scatters after the row-parallel ones, on gloo an all_reduce of a full-size copy, whose
  buffers are `buffers`;
- a pipeline with tensor parallelism: torch's receive buffers, whose stage input its first op
  saves (a buffer, not also an activation), and the outputs kept until their backward;
- ZeRO-1 as FSDP2 over the data axis: the flat all-gather buffer and the unsharded weights;
- the study's solver plan for four processes (ZB-V, two virtual stages per device, tp=2): the
  V turn passes its activations on the device, and the backward is split into input and
  weight passes (the input pass holds the output gradients captured for the weight pass, the
  incoming one in torch's gradient-receive buffer, and no weight gradient);
- context parallelism (keys and values all-gathered over cp): what attention saves is the
  gathered keys and values and the copy its batched matmul makes of the query, not the QKV
  projection's storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_hardware import fixed_local_profile

from shardc.plan.file import PlanFile
from shardc.run import launch_all, predict, resolve_plan
from shardc.study.compare import category_errors

NPROC = 4
MODEL = "examples/gpt.py:gpt?n_layer=4&n_embd=128&n_head=4&vocab_size=512&seq=64&batch=8"
SOLVER_PLAN = Path(__file__).resolve().parent / "data" / "study-session6" / "solver-4.plan"  # session 6's
PLANS = {  # kind -> plan text, or a plan file
    "sequence-parallel": "tp=4,sp=1,mb=8",
    "pipeline-tp": "tp=2,pp=2,mb=2",
    "zero-1": "dp=4,mb=2,zero=1",
    "solver-zbv": SOLVER_PLAN,
    "context-parallel": "dp=2,cp=2,mb=4",
}
TOTAL = 0.05
CATEGORY = 0.10


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fixed calibrated profile of `local`: the predictions do not depend on this machine's load."""
    with fixed_local_profile(tmp_path_factory.mktemp("shardc-cache")) as out:
        yield out


def _plan(source: Any) -> Any:
    return PlanFile.load(source) if isinstance(source, Path) else resolve_plan(source, NPROC)


@pytest.fixture(scope="module")
def checked(cache: Path) -> dict[str, list[dict[str, Any]]]:
    """Per kind, per rank: the measured and predicted totals and the category errors."""
    runs = [(MODEL, _plan(source)) for source in PLANS.values()]
    reports = launch_all(runs, nproc=NPROC, steps=2, seed=0, timeout_s=300)
    out: dict[str, list[dict[str, Any]]] = {}
    for kind, (spec, plan), got in zip(PLANS, runs, reports):
        est, note = predict(spec, plan, None, NPROC)
        assert est is not None, note
        parallel = plan.plan if isinstance(plan, PlanFile) else plan
        rows = []
        for r in got:
            stage = est.stages[min(r["rank"] // (parallel.dp * parallel.cp * parallel.tp), len(est.stages) - 1)]
            rows.append({"rank": r["rank"], "measured": r["peak_memory_bytes"], "predicted": stage.memory_bytes,
                         "categories": category_errors(r["peak_memory_breakdown"], stage.memory,
                                                       r["peak_memory_bytes"])})
        out[kind] = rows
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    return "\n".join(f"rank {r['rank']}: " + ", ".join(
        f"{c['category']} {c['measured_bytes']:,.0f}/{c['predicted_bytes']:,.0f}" for c in r["categories"])
        for r in rows)


@pytest.mark.parametrize("kind", list(PLANS))
def test_total_within_5_percent(kind: str, checked: dict[str, list[dict[str, Any]]]) -> None:
    rows = checked[kind]
    assert len(rows) == NPROC
    for r in rows:
        assert r["predicted"] == pytest.approx(r["measured"], rel=TOTAL), \
            f"{kind} rank {r['rank']}: measured {r['measured']:,.0f} B, predicted {r['predicted']:,.0f} B " \
            f"({r['predicted'] / r['measured'] - 1:+.1%})\n{_table(rows)}"


@pytest.mark.parametrize("kind", list(PLANS))
def test_every_category_within_10_percent(kind: str, checked: dict[str, list[dict[str, Any]]]) -> None:
    rows = checked[kind]
    misses = [f"rank {r['rank']} {c['category']}: measured {c['measured_bytes']:,.0f} B, predicted "
              f"{c['predicted_bytes']:,.0f} B ({c['error']:+.1%})"
              for r in rows for c in r["categories"] if c["error"] is not None and abs(c["error"]) > CATEGORY]
    assert not misses, f"{kind}: " + "; ".join(misses) + f"\n{_table(rows)}"


# The README study of session 6 (its report then; `benchmarks/study-report/` is a later run).
RESULTS = Path(__file__).resolve().parent / "data" / "study-session6" / "results.json"
# Recorded study plans that missed a category by more than 10% before issue 14's memory rules
# (README study, session 6) and whose recorded measurement the tracker's later rules do not change:
# mixed precision's fp32 loss, full recomputation's saved inputs, a pipeline's first stage. (The
# ZeRO, sequence-parallel and vocabulary-parallel plans were measured by a tracker that filed
# FSDP2's unsaved unsharded weights and an overwritten saved softmax otherwise, and dp x tp x sp
# then saved gathered copies: the four-process test above measures them anew. The pipeline plan
# pp=2,mb=2 ran a runtime that kept every micro-batch's output on the last stage to the step's
# end; pipelines now step torch's schedule with return_outputs=False, which keeps none, so its
# recorded last stage is not today's program: pipeline-tp above measures that anew.)
REPRICED = ("dp=2,mb=4,dtype=bf16", "dp=4,mb=2,dtype=bf16", "dp=2,mb=4,recompute=full")


def test_recorded_study_plans_repriced_within_targets(tmp_path: Path) -> None:
    """The offline re-check (`shardc.study.memory_check`): recorded plans of the README study,
    re-priced by today's model against the memory the study measured, meet both targets on
    every rank; before, each missed a category (the recorded predictions say by how much)."""
    import json
    import shutil

    from shardc.study.memory_check import meets, reprice
    from shardc.study.plans import label

    data = json.loads(RESULTS.read_text())
    data["plans"] = [p for p in data["plans"] if p["status"] == "ok" and label(p["plan"]) in REPRICED]
    assert len(data["plans"]) == len(REPRICED)
    (tmp_path / "results.json").write_text(json.dumps(data))
    shutil.copy(RESULTS.parent / "local-profile.json", tmp_path / "local-profile.json")
    rows = reprice(tmp_path / "results.json")
    assert [meets(r["recorded_worst"]) for r in rows].count((True, True)) == 0
    for row in rows:
        total, worst = row["repriced_worst"]
        assert meets(row["repriced_worst"]) == (True, True), f"{row['label']}: total {total:+.1%}, worst {worst}"


@pytest.mark.parametrize("query", ["per head from one projection", "contiguous"])
def test_a_matmul_saves_the_copy_torch_makes_of_an_operand_it_cannot_view(query: str) -> None:
    """`cost.saved.matmul_copy`'s probe (torch.matmul on meta tensors with the graph's strides)
    against autograd on real tensors: attention's query read per head from a QKV projection is
    saved as a copy of its own (context parallelism then keeps it, not the projection), a
    contiguous one as itself."""
    import torch

    from shardc.cost.saved import _saved_copy_ratio
    from shardc.ir import TensorType

    qkv = torch.randn(2, 16, 3 * 32, requires_grad=True)
    q = qkv.split(32, dim=2)[0].reshape(2, 16, 4, 8).permute(0, 2, 1, 3)
    if query == "contiguous":
        q = q.detach().contiguous().requires_grad_()
    keys = torch.randn(2, 4, 8, 16)  # gathered keys, transposed: contiguous
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.matmul(q, keys.requires_grad_())
    mine = q.untyped_storage().data_ptr()
    copied = [t for t in saved if t.untyped_storage().data_ptr() not in (mine, keys.untyped_storage().data_ptr())]
    ratio = _saved_copy_ratio((TensorType(tuple(q.shape), "f32"), TensorType(tuple(keys.shape), "f32")),
                              (tuple(q.stride()), tuple(keys.stride())), 0)
    assert ratio == (1.0 if copied else None)
    assert bool(copied) == (query != "contiguous")
    assert _saved_copy_ratio((TensorType(tuple(q.shape), "f32"), TensorType(tuple(keys.shape), "f32")),
                             (tuple(q.stride()), tuple(keys.stride())), 1) is None  # the keys are viewed
