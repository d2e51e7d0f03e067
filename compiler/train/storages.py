"""What each tensor storage a training rank holds is, for the memory tracker (`shardc.train.memory`).

Rules:
- A storage is told apart by its StorageImpl (`_key`), not its data pointer: FSDP2 frees and
  re-allocates unsharded parameters with `resize_`, which keeps the StorageImpl. A DTensor is
  counted as its local shard; fake, functional and meta tensors own no memory.
- `roles`: at a step's start, the module's parameters, their gradients, the optimizer's state,
  the registered module buffers, and torch pipelining's receive buffers (made before the step).
- `pipeline_buffers`: what torch.distributed.pipelining holds as runtime buffers at any moment
  (receive buffers, the outputs kept until their backward and to the step's end).
- `ddp_bucket_bytes`: DDP's flat gradient buckets, C++-side tensors Python cannot reach, from
  DDP's own log.
- `storages_now` / `storages_of`: storages alive at a moment, as weak references, so a run can
  leave out what the process held before it began.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _storage(t: torch.Tensor) -> Any | None:
    t = _local(t)
    if t.device.type == "meta":
        return None
    try:  # fake and functional tensors (left over from tracing) own no memory
        s = t.untyped_storage()
        return s if s.data_ptr() else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _key(storage: Any) -> int:
    """A storage's identity: its StorageImpl, which keeps its identity when `resize_` moves its data
    (FSDP2 frees and re-allocates unsharded parameters so), unlike the data pointer."""
    return int(getattr(storage, "_cdata", 0) or storage.data_ptr())


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def roles(modules: Iterable[torch.nn.Module], optimizer: Any) -> dict[int, str]:
    """Data pointer -> category for parameters, gradients, optimizer state and module buffers."""
    out: dict[int, str] = {}

    def put(t: torch.Tensor | None, cat: str) -> None:
        s = _storage(t) if t is not None else None
        if s is not None:
            out.setdefault(_key(s), cat)

    for m in modules:
        for p in m.parameters():
            put(p, "parameters")
            put(p.grad, "gradients")
        for b in m.buffers():
            put(b, "model_buffers")
        for stage in getattr(m, "stages", None) or ():  # torch pipelining's receive buffers, made before the step
            for infos in [*getattr(stage, "args_recv_info", {}).values(), *getattr(stage, "grad_recv_info", {}).values()]:
                for info in infos:
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, torch.Tensor):
                        put(buffer, "buffers")
    if optimizer is not None:
        for state in optimizer.state.values():
            for t in _tensors(state):
                put(t, "optimizer")
    return out


def ddp_bucket_bytes(module: Any) -> int:
    """Bytes of DDP's flat gradient buckets (C++-side tensors Python cannot reach), from DDP's log."""
    get = getattr(module, "_get_ddp_logging_data", None)
    if get is None:
        return 0
    data = get()
    if data.get("gradient_as_bucket_view"):
        return 0
    text = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
    return sum(int(x) for x in text.replace(" ", "").split(",") if x)


def _input_storages(args: tuple, kwargs: dict | None) -> list[Any]:
    return [s for s in (_storage(t) for t in _tensors((args, kwargs or {}))) if s is not None]



def storages_now() -> dict[int, Any]:
    """Every tensor storage Python can reach now (after a collection), by key, as weak references:
    what a process held before a run began (earlier runs' leftovers in a process that runs
    several), for `track_memory(ignore=...)`. A weak reference, not the key alone: a storage freed
    since and its key reused by a new one is not mistaken for it."""
    gc.collect()
    out: dict[int, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                s = _storage(obj)
                if s is not None:
                    out.setdefault(_key(s), weakref.ref(s))
    return out


def storages_of(tensors: Iterable[torch.Tensor]) -> dict[int, Any]:
    """`tensors`' storages by key, as weak references (`storages_now`'s form, for `ignore`)."""
    out: dict[int, Any] = {}
    for t in tensors:
        s = _storage(t)
        if s is not None:
            out.setdefault(_key(s), weakref.ref(s))
    return out


def pipeline_buffers(stages: Sequence[Any]) -> Callable[[], list[torch.Tensor]]:
    """What torch.distributed.pipelining's `stages` hold as runtime buffers at the moment it is
    called: every micro-batch's receive buffers (inputs, gradients of outputs), the outputs kept
    for backward (`fwd_cache`, the outputs only: its inputs are the receive buffers or the batch)
    and the outputs kept to the step's end (`output_chunks`)."""

    def held() -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for stage in stages:
            for infos in (*getattr(stage, "args_recv_info", {}).values(),
                          *getattr(stage, "grad_recv_info", {}).values()):
                out += [info.buffer for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]
            for cached in getattr(stage, "fwd_cache", {}).values():
                out += list(_tensors(cached[0]))
            out += list(_tensors(getattr(stage, "output_chunks", [])))
        return out

    return held
