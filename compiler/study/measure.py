"""Measuring one rank's training step for the study: bytes sent by collectives, and a time breakdown.

Memory and the collectives a step runs are recorded by the training loop's tracker
(`shardc.train.memory`); here each recorded collective is given the bytes this rank sends
under a ring algorithm: all_reduce 2(n-1)/n of the buffer, all_gather and reduce_scatter
(n-1)/n of the full buffer, broadcast (n-1)/n, send all of it.

Time (`profile_breakdown`, torch.profiler on one step): `compute` is the union of the main
thread's op intervals other than communication; `communication` the union of collective
intervals on any thread (gloo runs them on its own threads); `exposed_communication` the
part of it not hidden under compute; `waiting` the part of each collective spent for peers
to arrive, taken as its duration minus the shortest duration any rank saw for the same call
(the last rank to arrive does not wait; calls are matched by name, shapes and order), which
needs no clock shared between processes; `other` the rest of the step (Python, idle).
"""

from __future__ import annotations

from typing import Any

from shardc.ops.collectives import ring_traffic

COMM_MARKERS = ("c10d", "gloo", "nccl", "record_param_comms", "wait_tensor", "barrier")


def with_sent_bytes(collectives: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tracker's collective records, each with the bytes it sent (`shardc.ops.collectives.ring_traffic`)."""
    return [{**c, "sent_bytes": ring_traffic(c["kind"], c["group_size"]).fraction * c["bytes"]} for c in collectives]


# ---- time breakdown from torch.profiler -------------------------------------------------------

def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def is_comm(name: str) -> bool:
    return any(m in name for m in COMM_MARKERS)


def _on_device(e: Any) -> bool:
    """A GPU activity (kernel, copy, set), not a CPU op nor a GPU-side user annotation."""
    return str(getattr(e, "device_type", "CPU")).rsplit(".", 1)[-1] != "CPU" and not getattr(
        e, "is_user_annotation", False)


def profile_events(prof: Any, marker: str, device: str = "cpu") -> dict[str, Any]:
    """The profiled step as plain data: the step interval, compute and communication intervals
    (microseconds) and each collective call's (key, duration) in order, for `profile_breakdown`.
    On `device="cuda"` (a profile with CUDA activities, the step synchronised before the marker
    closes) compute and communication are the GPU's own intervals: NCCL kernels are
    communication, every other kernel, copy and set is compute; the CPU ops only launch them."""
    events = list(prof.events())
    step = next((e for e in events if e.name == marker and not _on_device(e)), None)
    if step is None:
        return {}
    if device == "cuda":
        return _device_profile(events, step)
    main = step.thread
    lo, hi = step.time_range.start, step.time_range.end
    compute, comm, calls = [], [], []
    counts: dict[tuple, int] = {}
    for e in events:
        if e is step or e.time_range.end < lo or e.time_range.start > hi:
            continue
        span = (max(lo, e.time_range.start), min(hi, e.time_range.end))
        if is_comm(e.name):
            comm.append(span)
            if e.name.startswith(("gloo:", "nccl:")) or (e.thread == main and e.name.startswith("c10d::")
                                                         and ("send" in e.name or "recv" in e.name)):
                key = (e.name, str(e.input_shapes))
                counts[key] = counts.get(key, 0) + 1
                calls.append((f"{key[0]}|{key[1]}|{counts[key]}", e.time_range.elapsed_us()))
        elif e.thread == main:
            compute.append(span)
    return {"step_us": hi - lo, "compute": _union(compute), "comm": _union(comm), "calls": calls}


def _device_profile(events: list[Any], step: Any) -> dict[str, Any]:
    lo, hi = step.time_range.start, step.time_range.end
    compute, comm, calls = [], [], []
    counts: dict[str, int] = {}
    for e in sorted((e for e in events if _on_device(e)), key=lambda e: e.time_range.start):
        if e.time_range.end < lo or e.time_range.start > hi:
            continue
        span = (max(lo, e.time_range.start), min(hi, e.time_range.end))
        if is_comm(e.name):  # ncclDevKernel_AllReduce_..., ncclKernel_...
            comm.append(span)
            counts[e.name] = counts.get(e.name, 0) + 1
            calls.append((f"{e.name}|{counts[e.name]}", e.time_range.elapsed_us()))
        else:
            compute.append(span)
    return {"step_us": hi - lo, "compute": _union(compute), "comm": _union(comm), "calls": calls}


def profile_breakdown(per_rank: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Seconds per category for each rank's profiled step (see the module docstring)."""
    shortest: dict[str, float] = {}
    for data in per_rank:
        for key, dur in data.get("calls", []):
            shortest[key] = min(shortest.get(key, dur), dur)
    out: list[Any] = []
    for data in per_rank:
        if not data:
            out.append({})
            continue
        compute, comm = _union(data["compute"]), _union(data["comm"])
        comp_s, comm_s = _length(compute), _length(comm)
        overlap = _intersect(compute, comm)
        waiting = sum(d - shortest[k] for k, d in data["calls"])
        step = data["step_us"]
        exposed = comm_s - overlap
        out.append({"step_s": step / 1e6, "compute_s": (comp_s - 0.0) / 1e6, "communication_s": comm_s / 1e6,
                    "exposed_communication_s": exposed / 1e6, "waiting_s": min(waiting, comm_s) / 1e6,
                    "other_s": max(0.0, step - comp_s - exposed) / 1e6})
    return out
