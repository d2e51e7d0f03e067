"""Memory per category, re-priced offline: a recorded study's measurements against today's model.

Rule. A study's results.json keeps, per plan and rank, the memory the tracker measured at the
peak by category (`measured_memory`, `shardc.train.memory`). `reprice` predicts every plan that
ran again with the current cost model (`study.predict`: the same partitioning and scoring the
study used, on the `local` cluster of the profile the study recorded beside its results, when
there is one) and compares it per rank with those measurements, per category as the study does
(`compare.category_errors`) and in total: nothing is run again. A plan file the study ran
(`plan_file=PATH`) is looked up at its recorded path, else beside results.json (the study copies
its solver plans there). The targets are the study's: each rank's total within 5%, each category
within 10%.

`python -m shardc.study.memory_check benchmarks/study-report/results.json` prints, per plan, its
worst total and category error as recorded (the model of the study's day) and as re-priced now,
and the count of plans that meet the targets under each.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from shardc.study.compare import category_errors, rel_error

TOTAL_TARGET = 0.05
CATEGORY_TARGET = 0.10


def _worst(ranks: list[dict[str, Any]]) -> tuple[float, dict[str, Any] | None]:
    """(the largest |total error| over the ranks, the category entry with the largest |error|)."""
    total = max((abs(r["memory_error"] or 0.0) for r in ranks), default=0.0)
    cats = [c for r in ranks for c in r["memory_categories"] if c["error"] is not None]
    return total, max(cats, key=lambda c: abs(c["error"]), default=None)


def check_ranks(measured: list[dict[str, Any]], predicted: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: the total error and the category errors of `predicted` (per rank: `memory`,
    `peak_memory_bytes`) against `measured` (per rank: `measured_memory` by the tracker's
    categories, `measured_peak_memory_bytes`)."""
    out = []
    for m, q in zip(measured, predicted, strict=True):
        peak = float(m["measured_peak_memory_bytes"])
        out.append({"rank": m["rank"], "memory_error": rel_error(float(q["peak_memory_bytes"]), peak),
                    "memory_categories": category_errors(m["measured_memory"], q["memory"], peak)})
    return out


def _study_plan(text: str, batch: int | None, results_dir: Path) -> Any:
    from shardc.study.plans import parse_study_plan

    if text.startswith("plan_file="):
        path = Path(text.partition("=")[2])
        if not path.is_file() and (results_dir / path.name).is_file():
            text = f"plan_file={results_dir / path.name}"
    return parse_study_plan(text, batch)


def reprice(results_path: str | Path, profile: Any = None) -> list[dict[str, Any]]:
    """Every plan of a recorded study that ran, re-priced by today's model (module rule): per
    plan its text, `recorded` and `repriced` per-rank checks (`check_ranks`), and the worst total
    and category error of each. `profile`: the LocalProfile to price on (default: the one beside
    results.json, else this machine's cached one)."""
    from shardc import driver
    from shardc.calibration.profile import read_profile
    from shardc.study.predict import partition, score, study_cluster

    path = Path(results_path)
    data = json.loads(path.read_text())
    beside = path.parent / "local-profile.json"
    if profile is None and beside.is_file():
        profile = read_profile(beside)
    source = driver.open_model(data["model"])
    clusters: dict[int, Any] = {}
    out = []
    for p in data["plans"]:
        if p.get("status") != "ok":
            continue
        sp = _study_plan(p["plan"], source.batch, path.parent)
        if p.get("split") and sp.split is None:
            sp = replace(sp, split=tuple(p["split"]))
        n = int(p["nproc"])
        if n not in clusters:
            clusters[n] = study_cluster(n, profile=profile)
        graph, _ = partition(source, sp, clusters[n])
        _, predicted = score(graph, sp, clusters[n])
        recorded = check_ranks(p["ranks"], [{"memory": r["predicted_memory"],
                                             "peak_memory_bytes": r["predicted_peak_memory_bytes"]}
                                            for r in p["ranks"]])
        now = check_ranks(p["ranks"], predicted["ranks"])
        out.append({"plan": p["plan"], "label": sp.label, "nproc": n, "recorded": recorded, "repriced": now,
                    "recorded_worst": _worst(recorded), "repriced_worst": _worst(now)})
    return out


def meets(worst: tuple[float, dict[str, Any] | None]) -> tuple[bool, bool]:
    """(total within 5%, every category within 10%) for a plan's `_worst`."""
    total, cat = worst
    return total <= TOTAL_TARGET, cat is None or abs(cat["error"]) <= CATEGORY_TARGET


def _cell(worst: tuple[float, dict[str, Any] | None]) -> str:
    total, cat = worst
    return f"{total:6.1%} | " + (f"{cat['category']} {cat['error']:+.1%}" if cat else "-")


def report(rows: list[dict[str, Any]]) -> str:
    """A markdown table: per plan, worst total and category error, recorded and re-priced; then the counts."""
    lines = ["| plan | n | recorded: worst total | worst category | re-priced: worst total | worst category |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['label']} | {row['nproc']} | {_cell(row['recorded_worst'])} | "
                     f"{_cell(row['repriced_worst'])} |")
    for key in ("recorded", "repriced"):
        ok = [meets(row[f"{key}_worst"]) for row in rows]
        lines.append(f"\n{key}: total within 5% on {sum(t for t, _ in ok)}/{len(rows)} plans, every category "
                     f"within 10% on {sum(c for _, c in ok)}/{len(rows)} plans, both on "
                     f"{sum(t and c for t, c in ok)}/{len(rows)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m shardc.study.memory_check RESULTS.json", file=sys.stderr)
        return 2
    print(report(reprice(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
