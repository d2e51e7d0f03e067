"""One rank's memory during one training step, by role, and the collectives it ran.

CPU has no allocator statistics, so every tensor is accounted for by hand; on CUDA the same
accounting gives the roles and the caching allocator's peak (`allocator_memory`) is the
measured peak, the difference filed as `allocator_extra`.
- At the start of the measured step, every tensor Python can reach (`gc.get_objects()`, a
  DTensor counted as its local shard) is filed by its role: `parameters` (the module's
  parameters), `gradients` (their `.grad`), `optimizer` (the optimizer's state), `buffers`
  (communication buffers: torch pipelining's receive buffers; DDP's gradient buckets live in
  C++ and are added from DDP's own `bucket_sizes` log), `model_buffers` (registered module buffers) and `other` (inputs,
  leftovers). Each storage is counted once.
- During the step a `TorchDispatchMode` sees every op the rank runs (backward included: the
  autograd engine carries the mode) and files each new output storage: saved for backward
  (a `saved_tensors_hooks` pack hook marks it) -> `activations`, except a parameter's cast to
  another dtype (mixed precision's compute-dtype weight copy, held from forward to backward by
  the op that saved it) -> `parameters` (a saved tensor that backward then overwrites in place
  is that backward's working memory from then on, `other`: Megatron's vocabulary-parallel cross
  entropy turns its saved softmax into the logits' gradient); produced by or handed to a
  collective -> `buffers`, and so is a parameter of the tracked modules that is not the
  parameters' state at rest (FSDP2's unsharded weights, gathered, whether an op saves them or
  not: a LayerNorm's weight or a bias is never saved); anything else (gradients of
  activations, temporaries of forward, backward and the optimizer step, recomputed forwards)
  -> `other`; the optimizer's state
  exists before the measured step (it follows the first step) and is counted as `optimizer`.
  A `weakref.finalize` on the storage takes it off the books when it is freed. Storages are
  re-measured after every op, so in-place `resize_` (FSDP2's gather buffers) is seen too.
  Storages are told apart by their StorageImpl, not their data pointer. Storages alive before
  the run began (`storages_now`: a study worker runs many plans in one process, and their
  leftovers are not this plan's memory) are left out unless they are the run's own state.
- A pipeline's runtime buffers, as the cost model defines them (`shardc.cost.peak`): the
  receive buffers torch.distributed.pipelining keeps per micro-batch (a stage's inputs and the
  gradients of its outputs), the stage outputs it keeps until their backward (`fwd_cache`) and
  the last stage's outputs it keeps to the step's end (`output_chunks`) are `buffers` whatever
  else happens to them: a receive buffer the stage's first op saves for backward stays a
  buffer, not an activation, and stays one after that backward (`pipeline_buffers`, re-read
  after every op).
- The peak is the largest total of live bytes after any op; its breakdown by role is kept,
  and the largest bytes each role reached on its own.

Collectives: the same dispatch mode records every c10d op this rank runs: its kind, the bytes
of its full buffer, its group size and whether forward, backward or the optimizer ran it.

What each storage is at the step's start, and the runtime's buffers: `shardc.train.storages`;
the kind of a collective op: `shardc.train.collective_kinds`.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardc.train.collective_kinds import _group_size, collective_kind
from shardc.train.storages import (
    _input_storages,
    _key,
    _local,
    _storage,
    _tensors,
    ddp_bucket_bytes,
    pipeline_buffers,
    roles,
    storages_now,
    storages_of,
)

__all__ = ["CATEGORIES", "MemoryTracker", "allocator_memory", "collective_kind", "ddp_bucket_bytes",
           "pipeline_buffers", "roles", "storages_now", "storages_of", "track_memory"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers", "model_buffers", "other")


class MemoryTracker(TorchDispatchMode):
    """Live tensor bytes by category during one step (see the module docstring)."""

    def __init__(self, known: dict[int, str], extra: dict[str, float] | None = None,
                 modules: Iterable[torch.nn.Module] = (), held: Callable[[], Iterable[torch.Tensor]] | None = None,
                 ignore: dict[int, Any] | None = None, detail: bool = False) -> None:
        super().__init__()
        self.modules = list(modules)
        self.held = held  # the runtime's buffers now (`pipeline_buffers`): filed `buffers` at every sample
        self.held_keys: set[int] = set()
        self.live: dict[int, tuple[Any, str]] = {}
        self.phase = "forward"
        self.extra = dict(extra or {})
        self.collectives: list[dict[str, Any]] = []
        self.peak = 0.0
        self.peak_breakdown: dict[str, float] = {}
        self.category_peaks: dict[str, float] = {}
        self.allocator: dict[str, float] | None = None  # CUDA: the allocator's view, set by `track_memory`
        self.casts: set[int] = set()  # storages made by casting a parameter (mixed precision's weight copies)
        self.detail = detail  # keep what made each storage, and the storages live at the peak (`peak_storages`)
        self.origins: dict[int, str] = {}
        self.peak_storages: list[tuple[str, int, str]] = []
        self.peak_when = ""
        with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    s = _storage(obj)
                    if s is None:
                        continue
                    earlier = (ignore or {}).get(_key(s))
                    if _key(s) not in known and earlier is not None and earlier() is s:
                        continue  # alive before this run began (`storages_now`): not its memory
                    self._add(obj, known.get(_key(s), "other"), "before the step")
        self._sample()

    def _add(self, t: torch.Tensor, category: str, origin: str = "") -> None:
        s = _storage(t)
        if s is None:
            return
        key = _key(s)
        if key in self.live:
            return
        self.live[key] = (weakref.ref(s), category)
        weakref.finalize(s, self.live.pop, key, None)
        if self.detail:
            self.origins[key] = f"{origin} {self.phase if self.phase == 'optimizer' else self._phase()} " \
                                f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"

    def mark_saved(self, t: torch.Tensor) -> None:
        """A tensor saved for backward: its storage counts as activations. Parameters are not
        activations, and neither are FSDP's gathered (unsharded) weights: the storage of a
        parameter of the tracked modules at the time it is saved is a communication buffer."""
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
            return
        s = _storage(t)
        if s is not None and _key(s) in self.held_keys:
            return  # a pipeline's receive buffer saved by the stage's first op: still the runtime's buffer
        if s is not None and _key(s) in self._parameter_storages():
            self._reclassify(t, ("other",), "buffers")
        elif s is not None and _key(s) in self.casts:
            self._reclassify(t, ("other",), "parameters")
        else:
            self._reclassify(t, ("other", "buffers"), "activations")

    def _parameter_storages(self) -> set[int]:
        out = set()
        for m in self.modules:
            for p in m.parameters():
                s = _storage(p)
                if s is not None:
                    out.add(_key(s))
        return out

    def _reclassify(self, t: torch.Tensor, old: tuple[str, ...], new: str) -> None:
        s = _storage(t)
        if s is None:
            return
        entry = self.live.get(_key(s))
        if entry is not None and entry[1] in old:
            self.live[_key(s)] = (entry[0], new)

    def _sample(self) -> None:
        if self.held is not None:
            self.held_keys = set()
            for t in self.held():
                s = _storage(t)
                if s is not None:
                    self._add(t, "buffers", "pipeline buffer")
                    self.live[_key(s)] = (self.live[_key(s)][0], "buffers")
                    self.held_keys.add(_key(s))
        for key in self._parameter_storages():  # FSDP2's unsharded weights: gathered, a buffer
            entry = self.live.get(key)
            if entry is not None and entry[1] == "other":
                self.live[key] = (entry[0], "buffers")
        totals = dict.fromkeys(CATEGORIES, 0.0)
        for ref, cat in list(self.live.values()):
            s = ref()
            if s is not None:
                totals[cat] += s.nbytes()
        for k, v in self.extra.items():
            totals[k] = totals.get(k, 0.0) + v
        total = sum(totals.values())
        for k, v in totals.items():
            self.category_peaks[k] = max(self.category_peaks.get(k, 0.0), v)
        if total > self.peak:
            self.peak, self.peak_breakdown = total, totals
            if self.detail:
                self.peak_when = self._phase() if self.phase != "optimizer" else "optimizer"
                self.peak_storages = sorted(((cat, s.nbytes(), self.origins.get(key, "?"))
                                             for key, (ref, cat) in self.live.items() if (s := ref()) is not None),
                                            key=lambda item: (item[0], -item[1]))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        comm = "c10d" in name
        if comm:
            self._record_collective(name, args)
            for t in _tensors(args):  # a buffer allocated before and filled by the collective
                self._reclassify(t, ("other",), "buffers")
        cat = "buffers" if comm and self.phase != "optimizer" else "other"
        if not comm and self._phase() == "backward" and _writes_in_place(func):
            for t in _tensors(out):  # a saved tensor overwritten in backward is no longer one (module rule)
                self._reclassify(t, ("activations",), "other")
        if func is torch.ops.aten._to_copy.default and args and isinstance(args[0], torch.Tensor):
            source = _storage(args[0])
            if source is not None and _key(source) in self._parameter_storages():
                for made in (_storage(t) for t in _tensors(out)):
                    if made is not None:  # forgotten when freed: a later storage may reuse the key
                        self.casts.add(_key(made))
                        weakref.finalize(made, self.casts.discard, _key(made))
        inputs = [_key(x) for x in _input_storages(args, kwargs)] if self.extra.get("buffers") else []
        for t in _tensors(out):
            s = _storage(t)
            if s is not None and _key(s) not in self.live and _key(s) in inputs:
                # Written into, not allocated: a buffer that existed before the step but Python
                # could not reach (DDP's buckets), already counted in `extra` from DDP's log.
                self.extra["buffers"] = max(0.0, self.extra["buffers"] - s.nbytes())
                self._add(t, "buffers")
                continue
            self._add(t, cat, name)
        self._sample()
        return out

    def _record_collective(self, name: str, args: tuple) -> None:
        kind = collective_kind(name)
        if kind is None:
            return
        # The full buffer: what all_reduce reduces, all_gather assembles, reduce_scatter splits.
        which = args[1] if kind == "reduce_scatter" and len(args) > 1 else args[0] if args else ()
        nbytes = sum(_local(t).numel() * _local(t).element_size() for t in _tensors(which))
        size = _group_size(args)
        self.collectives.append({"kind": kind, "bytes": nbytes, "group_size": size, "phase": self._phase()})

    def _phase(self) -> str:
        if self.phase == "optimizer":
            return "optimizer"
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    def result(self) -> dict[str, Any]:
        """`peak_bytes`, its `peak_breakdown` by role and each role's own peak (`category_peaks`).
        On CUDA the allocator's peak is the measurement: `peak_bytes` is its
        `peak_allocated_bytes`, `tracked_peak_bytes` the accounting's, and the breakdown files the
        difference as `allocator_extra`."""
        out: dict[str, Any] = {"peak_bytes": self.peak, "peak_breakdown": self.peak_breakdown,
                               "category_peaks": self.category_peaks}
        if self.detail:
            out["peak_storages"] = [list(item) for item in self.peak_storages]
            out["peak_when"] = self.peak_when
        if self.allocator is None:
            return out
        measured = self.allocator["peak_allocated_bytes"]
        return {**out, "peak_bytes": measured, "tracked_peak_bytes": self.peak, "allocator": self.allocator,
                "peak_breakdown": {**self.peak_breakdown, "allocator_extra": max(0.0, measured - self.peak)}}




def _writes_in_place(func: Any) -> bool:
    """Whether the aten op `func` writes into one of its arguments (`add_`, `mul_`, `out=`)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


@contextmanager
def track_memory(modules: Iterable[torch.nn.Module], optimizer: Any, extra: dict[str, float] | None = None,
                 device: torch.device | None = None, held: Callable[[], Iterable[torch.Tensor]] | None = None,
                 ignore: dict[int, Any] | None = None, detail: bool = False) -> Iterator[MemoryTracker]:
    """Account every tensor during the `with` body; set `tracker.phase = "optimizer"` around the
    optimizer step. On a CUDA `device` the allocator's peak is reset first and read after.
    `held`: the runtime's buffers at any moment (`pipeline_buffers`), filed as `buffers`;
    `ignore` (`storages_now()` taken before the run began): storages alive then that are none of
    the modules' and optimizer's are left out; `detail`: the result also lists the storages live
    at the peak (`peak_storages`: category, bytes, the op that made it, phase, shape, dtype)."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    mods = list(modules)
    gc.collect()
    tracker = MemoryTracker(roles(mods, optimizer), extra, mods, held, ignore, detail)

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        tracker.mark_saved(t)
        # An alias without the autograd history, and the base a view keeps alive (as autograd's own
        # saved view does: `precision.weight_copy` shares one weight copy while a view of it is
        # saved). A tensor saved whole would hold its own grad_fn (an op saving its output:
        # softmax, exp), a reference cycle autograd breaks only when backward frees the node, which
        # a retained graph's input-only nodes never are (torch's split backward,
        # `stage_backward_input`): the tracker would keep them alive to the step's end and beyond.
        return t.detach(), t._base

    def unpack(packed: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        return packed[0]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), tracker:
        yield tracker
    if cuda:
        torch.cuda.synchronize(device)
        tracker.allocator = allocator_memory(device)


def allocator_memory(device: Any) -> dict[str, float]:
    """The CUDA caching allocator's view of the last `reset_peak_memory_stats` window: peak bytes
    allocated to tensors (what `max_memory_allocated` reports), peak reserved from the driver,
    and the allocator's retries and OOMs (a peak that forced cache flushes)."""
    stats = torch.cuda.memory_stats(device)
    return {"peak_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
            "peak_reserved_bytes": float(torch.cuda.max_memory_reserved(device)),
            "allocated_bytes_now": float(torch.cuda.memory_allocated(device)),
            "num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
            "num_ooms": float(stats.get("num_ooms", 0))}


