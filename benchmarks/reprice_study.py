"""A recorded study priced again by today's model: no timings of this machine, only predictions.

`python benchmarks/reprice_study.py benchmarks/study-report/results.json` reads a study's
results (the plans, their measured step times and the predictions made before they ran) and the
profile it was predicted on (`local-profile.json` beside it, or `--profile`), predicts every plan
that ran again through the study's own front door (`shardc.study.predict.predict`: the same
partitioning and cost model as `shardc study`), and prints per plan the recorded and the new
prediction against the measured step, then the headline figures of both (median |error| of the
before-run prediction, plans predicted too fast, Spearman). `--pipeline-measure DIR` reads a
`benchmarks/pipeline_schedules.py --measure` directory the same way and prints its ratios to 1F1B.

What-ifs on the profile, for figures the calibration has not measured yet (say so when quoting
them): `--contention N=F` replaces the contention among N processes (`LocalProfile.contention`),
`--pipeline-action S` and `--split-walk S` the pipeline runtime's CPU seconds per schedule action
and per parameter tensor of a split backward (`EagerCosts.pipeline_action`, `.split_backward_per_tensor`),
`--loaded-from PROFILE` takes the collectives timed under a training load (`LocalProfile.loaded_collectives`,
the in-step wait of a blocking collective: `calibration.busy`) from another profile, e.g. a fresh
`shardc calibrate`, onto the one the study was predicted on (profiles from before version 5 have none),
`--split-refill S` a split backward's CPU seconds per byte its stage saved (`.split_backward_per_byte`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from shardc.calibration.profile import LocalProfile, read_profile
from shardc.study.compare import rel_error, spearman
from shardc.study.plans import parse_study_plan
from shardc.study.predict import predict, study_cluster


def load_profile(results: Path, given: str | None, contention: list[str], action: float | None = None,
                 walk: float | None = None, loaded_from: str | None = None,
                 refill: float | None = None) -> LocalProfile:
    """The profile the study was predicted on (`given`, else `local-profile.json` beside the
    results, else the cached one), with the what-ifs applied: `--contention`, and the pipeline
    runtime's CPU per action and per parameter tensor of a split backward (`EagerCosts`)."""
    path = Path(given) if given else results.parent / "local-profile.json"
    profile = read_profile(path) if path.exists() else read_profile()
    if contention:
        table = dict(profile.contention)
        for item in contention:
            n, _, factor = item.partition("=")
            table[int(n)] = float(factor)
        profile = replace(profile, contention=tuple(sorted(table.items())))
    if profile.eager is not None and (action is not None or walk is not None):
        eager = profile.eager
        profile = replace(profile, eager=replace(
            eager, pipeline_action=eager.pipeline_action if action is None else action,
            split_backward_per_tensor=eager.split_backward_per_tensor if walk is None else walk))
    if loaded_from:
        profile = replace(profile, loaded_collectives=read_profile(loaded_from).loaded_collectives)
    if profile.eager is not None and refill is not None:
        profile = replace(profile, eager=replace(profile.eager, split_backward_per_byte=refill))
    return profile


def reprice(data: dict[str, Any], profile: LocalProfile) -> list[dict[str, Any]]:
    """Per plan that ran: its text, processes, measured step, recorded and new prediction."""
    clusters: dict[int, Any] = {}
    rows = []
    for p in data["plans"]:
        if p.get("status") != "ok":
            continue
        sp = parse_study_plan(p["plan"])
        n = int(p.get("nproc") or sp.devices)
        if n not in clusters:
            clusters[n] = study_cluster(n, profile=profile)
        _, predicted = predict(data["model"], sp, clusters[n])
        rows.append({"plan": p["plan"], "nproc": n, "measured": p["measured_step_time_s"],
                     "before": p["predicted_step_time_s"], "after": predicted["step_time_s"]})
    return rows


def headline(rows: list[dict[str, Any]], key: str) -> str:
    errors = [rel_error(r[key], r["measured"]) for r in rows]
    rho = spearman([r[key] for r in rows], [r["measured"] for r in rows])
    return (f"median |error| {statistics.median(abs(e) for e in errors):.1%}, too fast {sum(e < 0 for e in errors)} "
            f"of {len(errors)}, Spearman {rho:.3f}")


def study_part(path: Path, profile: LocalProfile) -> None:
    data = json.loads(path.read_text())
    rows = reprice(data, profile)
    print(f"{'n':>2} {'measured':>9} {'recorded':>9} {'err':>7} {'now':>9} {'err':>7}  plan")
    for r in sorted(rows, key=lambda r: (r["nproc"], r["plan"])):
        print(f"{r['nproc']:2d} {r['measured'] * 1e3:9.1f} {r['before'] * 1e3:9.1f} "
              f"{rel_error(r['before'], r['measured']):+7.1%} {r['after'] * 1e3:9.1f} "
              f"{rel_error(r['after'], r['measured']):+7.1%}  {r['plan']}")
    for n in sorted({r["nproc"] for r in rows}):
        mine = [r for r in rows if r["nproc"] == n]
        print(f"{n} processes: recorded {headline(mine, 'before')}; now {headline(mine, 'after')}")
    print(f"all: recorded {headline(rows, 'before')}")
    print(f"all: now      {headline(rows, 'after')}")
    waits = sorted({(c.running, c.group) for c in profile.loaded_collectives})
    print("in-step wait per blocking collective: " + (", ".join(
        f"{g} of {n} running {profile.step_wait(n, g) * 1e6:.0f} us" for n, g in waits) or "none in this profile"))


def pipeline_part(folder: Path, profile: LocalProfile) -> None:
    from shardc.study.pipeline_measure import schedule_name, schedule_rows

    data = json.loads((folder / "results.json").read_text())
    rows = reprice(data, profile)
    now = {schedule_name(r["plan"]): r["after"] for r in rows}
    base = now["1f1b"]
    print(f"{'schedule':20} {'meas s':>7} {'rec s':>7} {'now s':>7} {'meas/1F1B':>9} {'recorded pred':>13} "
          f"{'now pred':>9} {'now err':>8}")
    for r in schedule_rows(data):
        ratio = now[r.schedule] / base
        print(f"{r.schedule:20} {r.measured_s:7.3f} {r.predicted_s:7.3f} {now[r.schedule]:7.3f} {r.measured_ratio:9.3f} "
              f"{r.predicted_ratio:13.3f} {ratio:9.3f} {r.measured_ratio / ratio - 1:+8.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", help="a study's results.json")
    ap.add_argument("--profile", help="the local profile it was predicted on (default: beside the results)")
    ap.add_argument("--pipeline-measure", help="a `pipeline_schedules.py --measure` directory instead")
    ap.add_argument("--contention", action="append", default=[], metavar="N=F",
                    help="what-if: the contention among N processes (repeatable)")
    ap.add_argument("--pipeline-action", type=float, help="what-if: CPU s per pipeline schedule action")
    ap.add_argument("--split-walk", type=float, help="what-if: CPU s per parameter tensor of a split backward")
    ap.add_argument("--loaded-from", metavar="PROFILE", help="the loaded collectives of another profile")
    ap.add_argument("--split-refill", type=float,
                    help="what-if: CPU s per saved byte of a split backward's stage (`EagerCosts.split_backward_per_byte`)")
    args = ap.parse_args()
    if args.pipeline_measure:
        folder = Path(args.pipeline_measure)
        pipeline_part(folder, load_profile(folder / "results.json", args.profile, args.contention, args.pipeline_action,
                                                   args.split_walk, args.loaded_from, args.split_refill))
    if args.results:
        path = Path(args.results)
        study_part(path, load_profile(path, args.profile, args.contention, args.pipeline_action, args.split_walk,
                                      args.loaded_from, args.split_refill))


if __name__ == "__main__":
    main()
