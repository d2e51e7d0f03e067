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
import contextlib
import io
import json
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "coverage_results.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
COLUMNS = ("inspect", "params", "estimate", "tp=2")
STEPS = 2
TOLERANCE = 1e-4

# (model type, kind): the kinds are the table's groups.
TYPES: tuple[tuple[str, str], ...] = (
    ("gpt2", "decoder"), ("gptj", "decoder"), ("gpt_neox", "decoder"),
    ("codegen", "decoder"), ("llama", "decoder"), ("mistral", "decoder"), ("qwen2", "decoder"),
    ("qwen3", "decoder"), ("phi", "decoder"), ("phi3", "decoder"), ("gemma", "decoder"),
    ("gemma2", "decoder"), ("granite", "decoder"), ("cohere", "decoder"), ("stablelm", "decoder"),
    ("starcoder2", "decoder"), ("olmo", "decoder"), ("olmo2", "decoder"), ("opt", "decoder"),
    ("bloom", "decoder"), ("falcon", "decoder"), ("biogpt", "decoder"),
    ("bert", "encoder"), ("roberta", "encoder"), ("distilbert", "encoder"), ("electra", "encoder"),
    ("albert", "encoder"), ("deberta-v2", "encoder"),
    ("bart", "encoder-decoder"), ("mbart", "encoder-decoder"), ("t5", "encoder-decoder"),
    ("mixtral", "moe"), ("qwen3_moe", "moe"), ("deepseek_v3", "moe"), ("olmoe", "moe"),
)

# The tiny config: each key is set where the type's config has it (aliases included).
TINY: dict[str, Any] = {
    "num_hidden_layers": 1, "num_layers": 1, "num_decoder_layers": 1, "encoder_layers": 1, "decoder_layers": 1,
    "n_layers": 1, "hidden_size": 64, "d_model": 64, "dim": 64, "num_attention_heads": 4, "num_heads": 4,
    "n_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "d_ff": 128, "hidden_dim": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "d_kv": 16, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64,
    "rotary_dim": 8, "embedding_size": 64, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 0,
    "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0, "tie_word_embeddings": False,
}
SHAPE = "batch=2&seq=16&labels=true"
# Per type: what the generic tiny config gets wrong (None: leave the key out).
OVERRIDES: dict[str, dict[str, Any]] = {
    "falcon": {"head_dim": None, "multi_query": False},  # one key/value head cannot split on tp=2
    "deepseek_v3": {"head_dim": 8, "num_key_value_heads": 4},  # head_dim: its rotary part, qk_rope_head_dim
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "deberta-v2": {"pooler_hidden_size": 64},
}


def spec_of(model_type: str) -> str:
    """The `hf:` spec of a type's tiny config: the TINY keys its config has, dropout off."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]()
    values = {k: v for k, v in TINY.items() if hasattr(defaults, k)} | OVERRIDES.get(model_type, {})
    for key, value in defaults.to_dict().items():
        if isinstance(value, float) and value > 0 and re.search(r"drop|pdrop", key) and "layerdrop" not in key:
            values[key] = 0.0
    for key, value in OVERRIDES.get(model_type, {}).items():
        if value is None:
            del values[key]
    query = "&".join(f"{k}={'none' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in values.items())
    return f"hf:{model_type}?{query}&{SHAPE}"


@dataclass
class Row:
    """One type's outcome: per column "pass", "fail: WHY" or "skip: WHY" (an earlier column failed)."""

    model_type: str
    kind: str
    spec: str
    results: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(self.results.get(c) == "pass" for c in COLUMNS)


def failing_op(err: BaseException | str) -> str:
    """The op an error (or a command's error output) names (`unsupported op aten.topk`), else
    its first line, short."""
    text = str(err)
    match = re.search(r"unsupported op (\S+)", text) or re.search(r"lowering (\S+) gave", text) \
        or re.search(r"(aten\.[\w.]+|torch\.ops\.aten\.[\w.]+)", text)
    if match:
        return match.group(1)
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return (first if isinstance(err, str) else f"{type(err).__name__}: {first}")[:200]


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """`shardc ARGV` in this process: exit code, stdout, stderr."""
    from shardc.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def check_inspect(spec: str) -> tuple[str, dict[str, Any]]:
    code, out, err = _cli(["inspect", spec, "--json", "--no-ir"])
    if code != 0:
        return f"fail: {failing_op(err.removeprefix('shardc inspect: error: ') or f'exit code {code}')}", {}
    return "pass", json.loads(out)


def _unused(model: Any, inputs: tuple[Any, ...]) -> list[str]:
    """Parameters the model's forward never reads (no gradient after one backward; BERT's
    `cls.predictions.bias` beside its decoder's own bias in transformers 5): no graph has them."""
    _loss_step(model)(inputs)
    unused = [name for name, p in model.named_parameters() if p.grad is None]
    model.zero_grad(set_to_none=True)
    return unused


def check_params(spec: str, inspected: dict[str, Any], notes: list[str]) -> str:
    model, inputs, _ = _build(spec)
    total, got = model.num_parameters(), int(inspected["params"])
    if got == total:
        return "pass"
    unused = _unused(model, inputs)
    params = dict(model.named_parameters())
    if got == total - sum(params[n].numel() for n in unused):
        notes.append(f"unused by forward: {', '.join(unused)}")
        return "pass"
    return f"fail: graph has {got:,} parameters, transformers {total:,}"


def check_estimate(spec: str) -> str:
    code, out, err = _cli(["estimate", spec, "--cluster", "2xA100-80GB", "--plan", "tp=2", "--json"])
    if code != 0:
        return f"fail: {failing_op(err.removeprefix('shardc estimate: error: ') or f'exit code {code}')}"
    result = json.loads(out)
    step, memory = float(result["step_time_s"]), float(result["memory_per_device_bytes"])
    return "pass" if step > 0 and memory > 0 else f"fail: predicted step {step} s, memory {memory} bytes"


# ---- tp=2 numerics: two gloo processes against one ---------------------------------------------

def _build(spec: str) -> tuple[Any, tuple[Any, ...], tuple[str, ...]]:
    import torch

    from shardc.frontend.spec import load_model

    torch.manual_seed(0)
    loaded = load_model(spec, device="cpu")
    return loaded.model, tuple(loaded.example_inputs), tuple(loaded.input_names)


def _batches(inputs: tuple[Any, ...], vocab: int) -> list[tuple[Any, ...]]:
    """STEPS batches shaped like the example inputs; the labels are the ids the model predicts."""
    import torch

    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        ids = [torch.randint(3, vocab, tuple(x.shape), generator=g) for x in inputs[:-1]]
        out.append((*ids, ids[-1].clone()))  # labels: the decoder's ids, else the input ids
    return out


def _train(step: Any, params: Iterable[Any], data: list[tuple[Any, ...]]) -> list[float]:
    import torch

    opt = torch.optim.AdamW(list(params), lr=1e-3, eps=1e-4)
    losses = []
    for batch in data:
        losses.append(float(step(batch)))
        opt.step()
        opt.zero_grad()
    return losses


def _loss_step(module: Any) -> Any:
    def step(batch: tuple[Any, ...]) -> Any:
        out = module(*batch)
        loss = out.loss if hasattr(out, "loss") else out[0] if isinstance(out, tuple | list) else out
        loss.backward()
        return loss.detach()
    return step


def _tp_worker(rank: int, world: int, spec: str, compiled: Any, vocab: int) -> tuple[list[float], dict[str, Any]]:
    import torch

    torch.use_deterministic_algorithms(True)
    model, inputs, _ = _build(spec)
    module = compiled.parallelize(model)
    losses = _train(_loss_step(module), module.parameters(), _batches(inputs, vocab))
    full = compiled.full_state_dict(module)
    return losses, ({k: v.detach().clone() for k, v in full.items()} if rank == 0 else {})


def check_tp2(spec: str) -> str:
    import torch

    import shardc
    from shardc.backends.torch.launch import spawn

    model, inputs, names = _build(spec)
    vocab = int(model.config.vocab_size)
    compiled = shardc.compile(model, inputs, plan="tp=2,dtype=fp32", input_names=names)
    (losses, full), _ = spawn(_tp_worker, 2, spec, compiled, vocab, timeout_s=900)
    torch.use_deterministic_algorithms(True)
    unused = set(_unused(model, inputs))
    ref_losses = _train(_loss_step(model), model.parameters(), _batches(inputs, vocab))
    if any(abs(a - b) > TOLERANCE * max(1.0, abs(b)) for a, b in zip(losses, ref_losses, strict=True)):
        return f"fail: losses {[round(x, 6) for x in losses]} vs one process {[round(x, 6) for x in ref_losses]}"
    for name, want in model.named_parameters():
        if name in unused:
            continue
        if name not in full:
            return f"fail: parameter {name} missing from the plan's state"
        if not torch.allclose(full[name], want.detach(), rtol=TOLERANCE, atol=1e-5):
            diff = float((full[name] - want.detach()).abs().max())
            return f"fail: parameter {name} off by {diff:.2e} after {STEPS} steps"
    return "pass"


def check_type(model_type: str, kind: str, columns: tuple[str, ...] = COLUMNS) -> Row:
    """`columns` (default: all) for one type; a column whose prerequisite failed is skipped."""
    start = time.perf_counter()
    row = Row(model_type, kind, "")
    try:
        row.spec = spec_of(model_type)
    except Exception as err:  # transformers without the type
        row.results = dict.fromkeys(COLUMNS, f"fail: {failing_op(err)}")
        return row
    inspected: dict[str, Any] = {}
    notes: list[str] = []
    for column in columns:
        if column != "inspect" and row.results.get("inspect") != "pass":
            row.results[column] = "skip: not traced"
            continue
        try:
            if column == "inspect":
                row.results[column], inspected = check_inspect(row.spec)
            elif column == "params":
                row.results[column] = check_params(row.spec, inspected, notes)
            elif column == "estimate":
                row.results[column] = check_estimate(row.spec)
            else:
                row.results[column] = check_tp2(row.spec)
        except Exception as err:
            row.results[column] = f"fail: {failing_op(err)}"
            if "--verbose" in sys.argv:
                traceback.print_exc()
    if inspected.get("replicated_ops"):
        notes.insert(0, "replicated: " + ", ".join(op.removeprefix("torch.ops.") for op in inspected["replicated_ops"]))
    if notes:
        row.results["notes"] = "; ".join(notes)
    row.seconds = round(time.perf_counter() - start, 1)
    return row


# ---- results and the README table -------------------------------------------------------------

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
