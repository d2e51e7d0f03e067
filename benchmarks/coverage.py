"""Which transformers model types shardc covers, checked the way a user would use them.

For each model type (a tiny config: one layer per stack, hidden 64, vocabulary 128, dropout off)
the script runs four checks on the `hf:TYPE?...&labels=true` spec (the model computes its own
loss, `shardc.frontend.spec`):
- inspect: `shardc inspect --json` traces it; a failure names the op the frontend stopped at;
- params: the traced graph's parameter count equals transformers' own `num_parameters()`;
- estimate: `shardc estimate --plan tp=2` on 2xA100-80GB prices it;
- tp=2: the plan `tp=2,dtype=fp32` trains STEPS AdamW steps on 2 gloo processes and matches one
  process (losses and every parameter to 1e-4 relative).

    python benchmarks/coverage.py                         # every type in TYPES
    python benchmarks/coverage.py --types t5,bart --jobs 2
    python benchmarks/coverage.py --readme-only           # rewrite the README table from the results

Results go to `benchmarks/coverage_results.json`, one entry per type, merged with what is there,
so runs over different `--types` (or interrupted ones) add up; the README table between
`<!-- coverage:begin -->` and `<!-- coverage:end -->` is rewritten from every stored entry.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

# The script is four modules beside it: the types and their tiny configs (`coverage_types`), the
# checks (`coverage_checks`), the results file and the README table (`coverage_table`), and this
# command line, which re-exports their names (`tests/test_coverage.py` imports them from here).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from coverage_checks import (  # noqa: E402
    COLUMNS,
    STEPS,
    TOLERANCE,
    Row,
    check_estimate,
    check_inspect,
    check_params,
    check_tp2,
    check_type,
    failing_op,
)
from coverage_table import (  # noqa: E402
    BEGIN,
    END,
    README,
    RESULTS,
    ROOT,
    load_results,
    save_results,
    table,
    table_rows,
    write_readme,
)
from coverage_types import OVERRIDES, SHAPE, TINY, TYPES, spec_of  # noqa: E402

__all__ = ["BEGIN", "COLUMNS", "END", "OVERRIDES", "README", "RESULTS", "ROOT", "SHAPE", "STEPS", "TINY", "TOLERANCE",
           "TYPES", "Row", "check_estimate", "check_inspect", "check_params", "check_tp2", "check_type", "failing_op",
           "load_results", "main", "save_results", "spec_of", "table", "table_rows", "write_readme"]


def _in_subprocess(model_type: str, kind: str, verbose: bool) -> Row:
    """One type checked by a fresh interpreter (`--one`): its spawned ranks need a parent that is
    no daemon, and a crash there loses one row only."""
    command = [sys.executable, str(Path(__file__).resolve()), "--one", f"{model_type}:{kind}"]
    done = subprocess.run(command + (["--verbose"] if verbose else []), capture_output=True, text=True, cwd=ROOT)
    if verbose:
        sys.stderr.write(done.stderr)
    last = done.stdout.strip().splitlines()[-1:] or [""]
    try:
        return Row(**json.loads(last[0]))
    except (json.JSONDecodeError, TypeError):
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return Row(model_type, kind, "", dict.fromkeys(COLUMNS, f"fail: {why[:160]}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", help="comma-separated model types (default: all of TYPES)")
    parser.add_argument("--skip-done", action="store_true", help="leave out types whose stored row passed")
    parser.add_argument("--jobs", type=int, default=1, help="types checked at once (each in its own process)")
    parser.add_argument("--readme-only", action="store_true", help="only rewrite the README table")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--one", metavar="TYPE:KIND", help=argparse.SUPPRESS)  # print one row as JSON
    args = parser.parse_args(argv)
    if args.one:
        model_type, _, kind = args.one.partition(":")
        print(json.dumps(asdict(check_type(model_type, kind))))
        return 0
    kinds = dict(TYPES)
    if not args.readme_only:
        stored = load_results(args.results)
        wanted = args.types.split(",") if args.types else [t for t, _ in TYPES]
        todo = [t for t in wanted if not (args.skip_done and t in stored and stored[t].passed)]
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = [pool.submit(_in_subprocess, t, kinds.get(t, "other"), args.verbose) for t in todo]
            for future in as_completed(futures):
                row = future.result()
                rows = load_results(args.results) | {row.model_type: row}  # other runs may write beside us
                save_results(rows, args.results)
                print(f"{row.model_type}: {row.results} ({row.seconds} s)", flush=True)
    write_readme(table_rows(load_results(args.results)), args.readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
