"""This machine as a cluster: `local_cluster` turns the measured profile (`shardc.calibration.profile`,
cached by `shardc calibrate`) into one node of N CPU processes, as `make_cluster` does a preset.

The processes share the machine's cores: every figure a process gets is its share while all N
compute at once (`LocalProfile.per_process_flops`), and the cluster records the core count
(`Cluster.shared_cores`) so that the cost model can give a process more than that share while
others wait (`shardc.cost.pipeline_shared`: a rank idle in a pipeline bubble lends its core).
"""

from __future__ import annotations

from dataclasses import replace

from shardc.calibration.profile import LocalProfile, at_speed, read_profile
from shardc.hardware import LOCAL_HEADROOM, Cluster, DeviceSpec, LinkSpec
from shardc.ir.diagnostics import ShardcError


def _default_local_procs() -> int:
    import os

    return max(1, os.cpu_count() or 1)


def local_cluster(nproc: int, profile: LocalProfile | None = None) -> Cluster:
    """This machine as one node of `nproc` CPU processes sharing its cores and memory, with gloo
    links, from `profile` (default: the cached one, `read_profile`; measuring it is
    `shardc calibrate`'s business). Everything a process does slows by the profile's sharing
    model (`LocalProfile.slowdown`), never below the speed of a process alone, and by the CPU
    time it loses to the others (`LocalProfile.contention_factor`). The cluster records the cores
    they share (`Cluster.shared_cores`)."""
    if nproc < 1:
        raise ShardcError(f"local cluster needs >= 1 process, got {nproc}")
    prof = profile or read_profile()
    prof = at_speed(prof, prof.contention_factor(nproc))  # the probe's own slowdown among nproc processes
    slow = max(1.0, prof.slowdown(nproc))
    flops = prof.per_process_flops(nproc)
    peaks = (("fp32", flops),) + tuple((d, flops * r) for d, r in prof.dtype_ratio)
    bandwidth = next((b for n, _, b in prof.concurrent if n == nproc), prof.memory_bandwidth / slow)
    memory = prof.memory_bytes // nproc
    eager = prof.eager.scaled(max(1.0, prof.eager_slowdown(nproc))) if prof.eager is not None else None
    if eager is not None:  # measured with the processes sharing the cores already: not scaled again
        # DDP's step was measured exposed; with a core per process its buckets overlap the backward
        # (the demo's dp=2 on 2 cores ran 6.4-7.5 ms where the exposed figure priced 9.3), so it
        # prices DDP only where the processes outnumber the cores and nothing overlaps.
        fits = tuple(f for f in prof.sync_step_fits(nproc) if f[0] != "ddp" or nproc > prof.cores)
        eager = replace(eager, sync_step=fits)
    device = DeviceSpec(f"local-cpu/{nproc}", peaks, memory, bandwidth, 1.0, prof.matmul_half_flops / slow,
                        prof.kernel_latency * slow, eager, headroom=LOCAL_HEADROOM)  # the model's error
    link = local_link(prof, nproc)
    return Cluster(device, 1, nproc, link, link, f"local{nproc}", shared_cores=max(1, prof.cores))


def local_link(profile: LocalProfile, nproc: int) -> LinkSpec:
    """The gloo link among `nproc` local processes: the ring that reproduces the all_reduce fit of
    the nearest measured count, pipeline messages priced by the send/recv fit, every
    collective measured at a group size no larger than these processes (a group of 2 among 4:
    the 2-process fit), and what a blocking collective of each group size waits inside a step
    with `nproc` processes running (`LocalProfile.step_wait`: a group of 2 among 4 measured with
    the other 2 computing)."""
    ring_fit = profile.nearest("all_reduce", nproc)
    ring = ring_fit.ring() if ring_fit is not None else None
    if ring_fit is None or ring is None:
        raise ShardcError("the local profile has no all_reduce measurement; rerun `shardc calibrate`")
    bandwidth, latency = ring
    send = profile.nearest("send_recv", nproc)
    p2p = None
    if send is not None:  # a pipeline's send is far cheaper than an all_reduce's ring step on gloo
        p2p = (send.fit.alpha, 1.0 / send.fit.beta if send.fit.beta > 0 else bandwidth)
    measured = tuple((c.op, c.nprocs, c.fit.alpha, c.fit.beta) for c in profile.collectives
                     if c.op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast") and c.points
                     and c.nprocs <= max(nproc, 2))
    groups = sorted({c.group for c in profile.loaded_collectives if c.group <= nproc})
    waits = tuple((g, profile.step_wait(nproc, g)) for g in groups)
    return LinkSpec(f"gloo-{ring_fit.nprocs}proc", bandwidth, latency, call_overhead=profile.call_overhead(nproc),
                    p2p=p2p, measured=measured, step_wait=waits)

