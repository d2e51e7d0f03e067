"""The results file of `benchmarks/coverage.py` (one `Row` per type, merged across runs) and the
README table written from it, between `BEGIN` and `END`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from coverage_checks import COLUMNS, Row
from coverage_types import TYPES

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "coverage_results.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"


def load_results(path: Path = RESULTS) -> dict[str, Row]:
    if not path.exists():
        return {}
    return {k: Row(**v) for k, v in json.loads(path.read_text()).items()}


def save_results(rows: dict[str, Row], path: Path = RESULTS) -> None:
    order = {t: i for i, (t, _) in enumerate(TYPES)}
    ordered = sorted(rows.values(), key=lambda r: (order.get(r.model_type, len(order)), r.model_type))
    path.write_text(json.dumps({r.model_type: asdict(r) for r in ordered}, indent=1) + "\n")


def _cell(result: str | None) -> str:
    if result is None:
        return "not run"
    if result == "pass":
        return "pass"
    return result.replace("|", "/")


def _notes(row: Row) -> str:
    """Replicated ops (torch cannot shard them) and unused parameters; older rows say `replicated`."""
    if "notes" in row.results:
        return row.results["notes"]
    return f"replicated: {row.results['replicated']}" if "replicated" in row.results else ""


def table(rows: Iterable[Row]) -> str:
    """The markdown table: one line per type, a summary line under it."""
    rows = list(rows)
    import transformers

    lines = [f"Tiny configs (one layer per stack, hidden 64), transformers {transformers.__version__}; "
             f"`python benchmarks/coverage.py` writes this table.", "",
             "| type | kind | " + " | ".join(COLUMNS) + " | notes |",
             "|---|---|" + "---|" * len(COLUMNS) + "---|"]
    for r in rows:
        cells = [_cell(r.results.get(c)) for c in COLUMNS]
        lines.append(f"| {r.model_type} | {r.kind} | " + " | ".join(cells) + f" | {_notes(r)} |")
    passed = sum(r.passed for r in rows)
    lines += ["", f"{passed} of {len(rows)} types pass every column."]
    return "\n".join(lines)


def table_rows(stored: dict[str, Row]) -> list[Row]:
    """Every type of TYPES in order (a type not yet checked has empty results: `not run`), then
    any other stored type."""
    kinds = dict(TYPES)
    return [stored.get(t, Row(t, kind, "")) for t, kind in TYPES] + [r for t, r in stored.items() if t not in kinds]


def write_readme(rows: Iterable[Row], path: Path = README) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers for the table")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{table(rows)}\n{END}{tail}")
