"""Sharded checkpoints with torch.distributed.checkpoint (DCP), loadable under any plan.

Layout of a checkpoint root: `step-00000005/` directories, each holding DCP's files, a
`manifest.json` (format, step, every parameter's full shape and dtype, tied names, the plan,
free-form `extra`) and a `COMMITTED` marker; and a `latest` file naming the newest one.

Rules:
- State is keyed by parameter name in the original model (the fully qualified name), never by
  rank or position, so DCP reshards by name: a checkpoint saved under one plan (dp/tp/pp, DTensor
  shards, pipeline stages) loads under any other, into the plain unpartitioned model, and back.
  Tied parameters (GPT's embedding and head) are stored once, under their first name.
- A save writes into `step-N.tmp-<id>/`, and only after every rank has finished and the manifest
  is on disk does rank 0 rename it to `step-N/`, write `COMMITTED` last, then replace `latest`.
  A save interrupted at any point (a rank killed mid-write) therefore leaves the previous
  checkpoint and `latest` untouched; leftover `*.tmp-*` directories are ignored and cleaned by
  the next save.
- Loading checks the manifest against the model first: a checkpoint from another model is an
  error listing the missing, unexpected and differently shaped parameters.
- Modules from `plan.parallelize` (any plan: pp=1 or pipelined, DDP or FSDP2 inside) hold plain
  local shards; `shard_state.StateViews` presents them (and their optimizer state) as DTensors
  by the plan's layouts, so they save and load like any DTensor model, across plans.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import torch_dtype

FORMAT = "shardc-checkpoint/1"
MARKER = "COMMITTED"
MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What a load found: the directory, the step, the saved plan and the `extra` dictionary."""

    path: Path
    step: int
    plan: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ---- the model as named parameters --------------------------------------------------------

def _module_of(model: Any) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    raise ShardcError(f"cannot checkpoint a {type(model).__name__}; give an nn.Module: the plain model, one "
                      "holding DTensor shards, or a module from plan.parallelize (pipelined or not)")


def _tied_of(module: nn.Module) -> list[tuple[str, ...]]:
    """Names sharing one parameter, in order of appearance (the first is the canonical one)."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [tuple(v) for v in groups.values() if len(v) > 1]


def _canonical(tied: Iterable[tuple[str, ...]]) -> dict[str, str]:
    return {alias: names[0] for names in tied for alias in names}


def named_state(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, str], list[tuple[str, ...]]]:
    """This rank's parameters and persistent buffers by canonical name (DTensors kept as they
    are), plus canonical->own name and the tied groups."""
    module = _module_of(model)
    tied = _tied_of(module)
    canon = _canonical(tied)
    out: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    saved = set(module.state_dict().keys())  # non-persistent buffers are the model's to rebuild, not state
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
        if name not in saved and not isinstance(t, nn.Parameter):
            continue
        key = canon.get(name, name)
        if key not in out:
            out[key] = t
            names[key] = name
    return out, names, tied


def _global_shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)  # a DTensor reports its global shape


def _describe(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    return {k: {"shape": _global_shape(v), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in state.items()}


def _gather_union(local: dict[str, Any]) -> dict[str, Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(local)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: dict[str, Any] = {}
    for p in parts:
        merged.update(p)
    return merged


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _broadcast_text(text: str) -> str:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return text
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


# ---- optimizer state ----------------------------------------------------------------------

def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazy state (Adam moments) by one step with zero gradients and lr 0."""
    if optimizer.state:
        return
    saved_grads = []
    lrs = []
    for group in optimizer.param_groups:
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = 0.0
        for p in group["params"]:
            saved_grads.append(p.grad)
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    it = iter(saved_grads)
    for group, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            group["lr"] = lr
        for p in group["params"]:
            p.grad = next(it)


def _optimizer_entries(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor],
                       model: Any) -> dict[str, Any]:
    """Optimizer state keyed `optim.<param name>.<state name>`, hyperparameters `optim.groups`."""
    by_id: dict[int, str] = {}
    module = _module_of(model)
    canon = _canonical(_tied_of(module))
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), canon.get(name, name))
    groups, tensors = _optimizer_tensors(optimizer, by_id, "model",
                                         "build the optimizer from this rank's parameters (model.parameters())")
    out: dict[str, Any] = {f"optim.{name}.{key}": value for name, key, _, value in tensors}
    out["optim.groups"] = groups
    return out


def _optimizer_tensors(optimizer: torch.optim.Optimizer, by_id: dict[int, str], holder: str,
                       hint: str) -> tuple[list[dict[str, Any]], list[tuple[str, str, torch.Tensor, torch.Tensor]]]:
    """The optimizer's hyperparameters per group, and its tensor states as (parameter name,
    state name, parameter, value). Parameters are found by `id`: tensors compare elementwise,
    so they cannot be dictionary keys. One the `holder` lacks is an error (with `hint`)."""
    groups: list[dict[str, Any]] = []
    tensors: list[tuple[str, str, torch.Tensor, torch.Tensor]] = []
    for group in optimizer.param_groups:
        groups.append({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            if id(p) not in by_id:
                raise ShardcError(f"the optimizer holds a parameter that is not in the {holder} being checkpointed",
                                  hint=hint)
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors.append((by_id[id(p)], key, p, value))
    return groups, tensors


# ---- save ---------------------------------------------------------------------------------

def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest committed checkpoint under `root` (the `latest` pointer, else the highest step)."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.exists():
        target = root / pointer.read_text().strip()
        if (target / MARKER).exists():
            return target
    done = sorted(p for p in root.glob("step-*") if ".tmp-" not in p.name and (p / MARKER).exists())
    return done[-1] if done else None


def _shardc_state(model: Any, optimizer: torch.optim.Optimizer | None, loading: bool) -> tuple[
        dict[str, Any], dict[str, torch.Tensor], list[tuple[str, ...]], Any]:
    """(DCP state, the DTensor view of each parameter, tied names, the StateViews) of a shardc module."""
    from shardc.backends.torch.shard_state import StateViews

    views = StateViews(model)
    named = views.named()
    params = {k: views.view(k, t, loading) for k, t in named.items()}
    state: dict[str, Any] = {f"model.{k}": v for k, v in params.items()}
    if optimizer is not None:
        if loading:
            _init_optimizer_state(optimizer)
        groups, tensors = _optimizer_tensors(optimizer, {id(p): k for k, p in named.items()}, "module",
                                             "build the optimizer from module.parameters()")
        for name, key, p, value in tensors:
            same = value.shape == p.shape and value.dim() > 0
            state[f"optim.{name}.{key}"] = views.view(name, value, loading) if same else value
        state["optim.groups"] = groups
    return state, params, [tuple(t) for t in getattr(views.inner, "shardc_tied", ())], views


def save_checkpoint(root: str | Path, model: Any, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int, plan: str = "", extra: Mapping[str, Any] | None = None) -> Path:
    """Save model (and optimizer) state of every rank as one checkpoint `root/step-N`; collective.

    `model` is an nn.Module: plain, holding DTensor shards, or from `plan.parallelize` (pipelined
    or not). Every rank must call it. Returns the committed directory.
    """
    import torch.distributed.checkpoint as dcp

    from shardc.backends.torch.shard_state import shardc_parts

    root = Path(root)
    if shardc_parts(model) is not None:
        state, params, tied, _ = _shardc_state(model, optimizer, loading=False)
    else:
        params, _, tied = named_state(model)
        state = {f"model.{k}": v for k, v in params.items()}
        if optimizer is not None:
            state.update(_optimizer_entries(optimizer, params, model))
    described = _gather_union(_describe(params))
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:08d}"
    tmp = Path(_broadcast_text(str(root / f"step-{step:08d}.tmp-{uuid.uuid4().hex[:8]}")))
    dcp.save(state, checkpoint_id=str(tmp), no_dist=not (dist.is_available() and dist.is_initialized()))
    _barrier()  # every rank's shard is on disk before anything is committed
    if _rank() == 0:
        manifest = {"format": FORMAT, "step": step, "plan": plan, "params": described,
                    "tied": [list(t) for t in tied], "optimizer": optimizer is not None,
                    "extra": dict(extra or {})}
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_synced(final / MARKER, "ok\n")
        _write_synced(root / "latest.tmp", final.name + "\n")
        os.replace(root / "latest.tmp", root / "latest")
    _barrier()
    return final


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ---- load ---------------------------------------------------------------------------------

def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a committed checkpoint directory (or of `latest` under a root)."""
    path = Path(path)
    if not (path / MARKER).exists():
        found = latest_checkpoint(path)
        if found is None:
            raise ShardcError(f"no committed checkpoint at {path}",
                              hint="a directory without COMMITTED is an interrupted save; give the checkpoint root or a step-N directory")
        path = found
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ShardcError(f"{path} is not a shardc checkpoint (format {manifest.get('format')!r})")
    manifest["_path"] = str(path)
    return manifest


def check_compatible(manifest: Mapping[str, Any], expected: Mapping[str, Mapping[str, Any]]) -> None:
    """Raise a ShardcError naming what differs between a checkpoint's parameters and the model's."""
    saved = manifest["params"]
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = sorted(k for k in set(saved) & set(expected)
                    if list(saved[k]["shape"]) != list(expected[k]["shape"]))
    if not (missing or unexpected or shapes):
        return
    lines = [f"checkpoint {manifest['_path']} is from another model:"]
    if missing:
        lines.append(f"  {len(missing)} parameters missing from the checkpoint: {', '.join(missing[:6])}"
                     + (" ..." if len(missing) > 6 else ""))
    if unexpected:
        lines.append(f"  {len(unexpected)} parameters not in the model: {', '.join(unexpected[:6])}"
                     + (" ..." if len(unexpected) > 6 else ""))
    for k in shapes[:6]:
        lines.append(f"  {k}: checkpoint shape {tuple(saved[k]['shape'])}, model shape {tuple(expected[k]['shape'])}")
    raise ShardcError("\n".join(lines), hint="load a checkpoint saved from the same model configuration")


def load_checkpoint(path: str | Path, model: Any, optimizer: torch.optim.Optimizer | None = None) -> CheckpointInfo:
    """Load a checkpoint (a root: its latest; or a step-N directory) into `model` in place; collective.

    Works across plans: each rank asks DCP for the slices its own parameters (plain tensors or
    DTensor shards) need. Loading the optimizer requires a checkpoint saved with one.
    """
    import torch.distributed.checkpoint as dcp

    from shardc.backends.torch.shard_state import shardc_parts

    manifest = read_manifest(path)
    if optimizer is not None and not manifest.get("optimizer"):
        raise ShardcError(f"checkpoint {manifest['_path']} holds no optimizer state",
                          hint="load it without an optimizer, or save with one")
    views = None
    if shardc_parts(model) is not None:
        state, params, _, views = _shardc_state(model, optimizer, loading=True)
        check_compatible(manifest, _gather_union(_describe(params)))
    else:
        params, _, _ = named_state(model)
        check_compatible(manifest, _gather_union(_describe(params)))
        state = {f"model.{k}": v for k, v in params.items()}
        if optimizer is not None:
            _init_optimizer_state(optimizer)
            state.update(_optimizer_entries(optimizer, params, model))
    no_dist = not (dist.is_available() and dist.is_initialized())
    with torch.no_grad():
        dcp.load(state, checkpoint_id=manifest["_path"], no_dist=no_dist)
    if views is not None:
        views.run_writebacks()
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, state["optim.groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
    return CheckpointInfo(Path(manifest["_path"]), int(manifest["step"]), manifest.get("plan", ""),
                          dict(manifest.get("extra", {})))


def full_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole model state of a checkpoint as plain tensors on one process (for `load_state_dict`).

    Every tied name gets the shared tensor, so the result loads into the unpartitioned model.
    """
    import torch.distributed.checkpoint as dcp

    manifest = read_manifest(path)
    state = {f"model.{k}": torch.empty(v["shape"], dtype=torch_dtype(v["dtype"])) for k, v in manifest["params"].items()}
    dcp.load(state, checkpoint_id=manifest["_path"], no_dist=True)
    out = {k.removeprefix("model."): v for k, v in state.items()}
    for group in manifest["tied"]:
        for alias in group[1:]:
            out[alias] = out[group[0]]
    return out
