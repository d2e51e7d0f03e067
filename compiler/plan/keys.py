"""The plan's text vocabulary: its keys (`PLAN_KEYS`: type, default, meaning, in printed order),
the values some keys take (schedules, cp layouts), and how one `key=value,...` text reads into
the fields of a `ParallelPlan` (`read_values`, what `ParallelPlan.parse` builds the plan from).

Every error names the key, the text given and what is valid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from shardc.ir import RECOMPUTE_CHOICES, ZERO_STAGES, Axis
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import PLAN_DTYPES

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "interleaved-zb", "dualpipev")
# The zero-bubble schedules (backward split into input- and weight-gradient passes), and those of
# them that place two virtual stages per device in a V (`shardc.analysis.stages.stage_device`).
ZB_SCHEDULES = ("zbv", "interleaved-zb", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")
CP_LAYOUTS = ("contiguous", "zigzag")
ZERO_TEXT = ", ".join(map(str, ZERO_STAGES))  # the valid ZeRO stages, as errors list them

# key -> (type, default, meaning); the order here is the printed order.
# Keys printed only away from their default, so plans that do not use them print as before.
OPTIONAL_KEYS: tuple[str, ...] = ("recompute_layers", "compile", "ep")
PLAN_KEYS: Mapping[str, tuple[str, str, str]] = MappingProxyType({
    Axis.DP: ("int", "1", "data-parallel degree (DDP, or FSDP when zero>0)"),
    Axis.TP: ("int", "1", "tensor-parallel degree (Megatron column/row parallel linears, heads split)"),
    Axis.PP: ("int", "1", "pipeline-parallel degree (number of stages)"),
    "vpp": ("int", "1", "virtual stages per device; >1 means the interleaved 1F1B schedule (or, with "
            "schedule=interleaved-zb, interleaved zero bubble; zbv and dualpipev need vpp=2)"),
    Axis.CP: ("int[:zigzag]", "1", "context-parallel degree (ring attention over the sequence); cp=N:zigzag "
           "balances causal attention (2N chunks, rank i holds i and 2N-1-i)"),
    "sp": ("0|1", "0", "sequence parallel: shard norms/dropout over the sequence across tp ranks"),
    "mb": ("int", "1", "micro-batch size (sequences per micro-batch per data-parallel rank)"),
    "gbs": ("int|auto", "auto", "global batch (sequences per optimizer step); auto: the model's batch"),
    "schedule": ("|".join(SCHEDULES), "1f1b", "pipeline schedule; zbv, interleaved-zb and dualpipev are "
                 "torch's zero-bubble schedules (backward split into input- and weight-gradient passes; zbv "
                 "and dualpipev place stages r and 2pp-1-r on pp rank r, with vpp=2)"),
    "recompute": ("|".join(RECOMPUTE_CHOICES), "none", "activation recomputation of the transformer blocks "
                  "(full: the whole block; selective: its attention core; the embedding and head never)"),
    "recompute_layers": ("int|all", "all", "with recompute=full|selective, only the first N blocks of each "
                         "pipeline model chunk recompute, the rest none (Megatron's --recompute-num-layers, "
                         "block method); printed only when not all"),
    "zero": (f"{ZERO_STAGES[0]}-{ZERO_STAGES[-1]}", "0", "ZeRO stage: 1 shards optimizer states, 2 also grads, 3 also weights"),
    "dtype": ("|".join(PLAN_DTYPES), "bf16", "compute dtype; bf16/fp16 keep fp32 master weights and Adam states"),
    "compile": ("auto|0|1", "auto", "run each rank's module through torch.compile (inductor) and price its fused "
                "kernels; auto: on for CUDA devices, off for CPU processes; printed only when not auto"),
    Axis.EP: ("int", "1", "expert-parallel degree: an MoE layer's experts split over ep ranks, tokens dispatched "
              "and combined by all-to-all; every other op splits each micro-batch over them (mb must be a "
              "multiple of ep); its mesh axis sits inside dp; printed only when not 1"),
})


def read_flag(key: str, text: str) -> bool:
    """A 0/1 key's value (also true/false, on/off, yes/no)."""
    t = text.strip().lower()
    if t in ("1", "true", "on", "yes"):
        return True
    if t in ("0", "false", "off", "no"):
        return False
    raise ShardcError(f"plan key {key}={text!r}: expected 0 or 1 (also true/false, on/off)")


def _read_compile(raw: str) -> bool:
    try:
        return read_flag("compile", raw)
    except ShardcError:
        raise ShardcError(f"plan key compile={raw!r}: expected auto, 0 or 1 (auto: torch.compile on CUDA "
                          "devices, eager on CPU processes)") from None


def _refuse_offload(raw: str, text: str) -> None:
    """`offload=0` reads as nothing (plans printed before the key was removed carry it);
    `offload=1` is refused: no backend moves optimizer states to host memory, so a plan
    asking for it would be priced and run as something it is not."""
    if not read_flag("offload", raw):
        return
    raise ShardcError(f"plan key offload={raw} in {text!r}: optimizer-state offload to host memory is not "
                      "supported (no backend executes it, so shardc neither prices nor plans it)",
                      hint="drop the offload key from the plan; to save device memory use zero=1..3 "
                           "or recompute=full")


def read_int(key: str, text: str, low: int = 1) -> int:
    """An integer key's value, at least `low`."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise ShardcError(f"plan key {key}={text!r}: expected an integer >= {low}")
    return value


def read_choice(key: str, text: str, choices: tuple[str, ...], spelling: Callable[[str], str] | None = None) -> str:
    """`text` as one of `choices`, after `spelling` maps its aliases to the canonical name."""
    t = text.strip().lower()
    t = spelling(t) if spelling else t
    if t not in choices:
        raise ShardcError(f"plan key {key}={text!r}: valid values are {', '.join(choices)}")
    return t


def read_values(text: str) -> dict[str, Any]:
    """The fields `key=value,key=value,...` gives a `ParallelPlan` (keys left out are absent: they
    take their defaults); the dataclass then checks how the values combine."""
    values: dict[str, Any] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        key, eq, raw = item.partition("=")
        key, raw = key.strip().lower(), raw.strip()
        if key == "offload":
            _refuse_offload(raw, text)
            continue
        if key not in PLAN_KEYS:
            raise ShardcError(f"unknown plan key {key!r} in {text!r}; known keys: {', '.join(PLAN_KEYS)}",
                              hint="write the plan as e.g. dp=8,tp=8,pp=4,mb=1,gbs=512,recompute=full")
        if not eq or not raw:
            raise ShardcError(f"plan key {key!r} has no value in {text!r}; write {key}=VALUE "
                              f"({PLAN_KEYS[key][0]})")
        if key in values:
            raise ShardcError(f"plan key {key!r} given twice in {text!r}")
        if key == "sp":
            values[key] = read_flag(key, raw)
        elif key == "compile":
            values[key] = None if raw.lower() == "auto" else _read_compile(raw)
        elif key == "gbs":
            values[key] = None if raw.lower() == "auto" else read_int(key, raw)
        elif key == "recompute_layers":
            if raw.lower() != "all" and not (raw.isdigit() and raw.isascii()):
                raise ShardcError(f"plan key recompute_layers={raw!r}: expected an integer >= 0 or all")
            values[key] = None if raw.lower() == "all" else int(raw)
        elif key == "zero":
            values[key] = read_int(key, raw, 0)
            if values[key] not in ZERO_STAGES:
                raise ShardcError(f"plan key zero={raw!r}: valid values are {ZERO_TEXT}")
        elif key in ("schedule", "recompute", "dtype"):
            values[key] = raw
        elif key == Axis.CP and ":" in raw:
            degree, _, layout = raw.partition(":")
            values[key], values["cp_layout"] = read_int(key, degree), read_choice("cp", layout, CP_LAYOUTS)
        else:
            values[key] = read_int(key, raw)
    if str(values.get("schedule", "")).lower() == "interleaved" and values.get("vpp", 1) == 1:
        raise ShardcError("plan has schedule=interleaved with vpp=1; set vpp>=2 (virtual stages per "
                          "device) or schedule=1f1b")
    return values


def plan_keys_help() -> str:
    """`PLAN_KEYS` as help text, one key a line: `  dp=int (default 1)  data-parallel degree ...`."""
    rows = [(f"{k}={t}", f"(default {d})", m) for k, (t, d, m) in PLAN_KEYS.items()]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    return "\n".join(f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)
