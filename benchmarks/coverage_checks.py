"""The four checks `benchmarks/coverage.py` runs on one model type (inspect, params, estimate,
tp=2; see its docstring), each giving "pass", "fail: WHY" or "skip: WHY", gathered in a `Row`."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from coverage_types import spec_of

COLUMNS = ("inspect", "params", "estimate", "tp=2")
STEPS = 2
TOLERANCE = 1e-4


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
