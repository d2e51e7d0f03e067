"""Memory headroom: each GPU preset reserves the CUDA context, NCCL's buffers and the allocator's
fragmentation; plans must fit in what is left (`usable_memory_bytes`), which `--memory-limit`
replaces. The estimate's fit, its report, and the solver all judge against the usable figure."""

from __future__ import annotations

import dataclasses
import json

import pytest
from traced import PRESETS, gpt_graph

from shardc.cli import main
from shardc.cost import estimate
from shardc.driver import solve
from shardc.hardware import PRESETS as HW
from shardc.hardware import GiB, Headroom, local_cluster, parse_cluster, with_memory_limit, with_overrides
from shardc.ir.diagnostics import ShardcError
from shardc.ir.printer import print_graph
from shardc.plan.parallel import ParallelPlan


def test_gpu_presets_reserve_context_nccl_and_fragmentation() -> None:
    a100 = HW["A100-80GB"].device
    # 0.5 GiB context + 1 GiB NCCL + 5% of 80 GiB
    assert a100.usable_memory_bytes == 80 * GiB - GiB // 2 - GiB - 4 * GiB
    assert a100.describe_headroom() == "5.5 GiB (context 512 MiB, NCCL 1 GiB, fragmentation 5%)"
    h200 = HW["H200"].device
    assert h200.usable_memory_bytes == 141 * GiB - 3 * GiB // 2 - int(0.05 * 141 * GiB)
    for p in HW.values():
        assert 0.9 * p.device.memory_bytes < p.device.usable_memory_bytes < p.device.memory_bytes


def test_local_cluster_reserves_the_memory_models_error() -> None:
    """No runtime reserve on the CPU processes (the tracker's baseline holds it), but 5% for the
    memory model's measured error (`LOCAL_HEADROOM`): a plan predicted to fit fits when run."""
    from test_hardware import _profile

    device = local_cluster(2, _profile()).device
    assert device.usable_memory_bytes == device.memory_bytes - int(0.05 * device.memory_bytes)
    assert device.describe_headroom().endswith("(the memory model's error, 5%)")
    # a plan at the usable figure, measured 5% above its prediction (the closed loop's tolerance),
    # still peaks under the capacity
    assert device.usable_memory_bytes * 1.05 < device.memory_bytes
    # `--memory-limit` is the usable figure itself, as on every preset
    assert with_memory_limit(local_cluster(2, _profile()), 0.5).device.usable_memory_bytes == GiB // 2
    with pytest.raises(ValueError, match="model_error >= 0 summing below 1"):
        Headroom(fragmentation=0.5, model_error=0.5)


def test_memory_limit_replaces_the_headroom() -> None:
    cluster = with_memory_limit(parse_cluster("8xA100-80GB"), 70)
    assert cluster.device.usable_memory_bytes == 70 * GiB and cluster.device.memory_bytes == 80 * GiB
    assert cluster.device.describe_headroom() == "not counted: --memory-limit 70 GiB"
    # a limit above the capacity is a what-if, taken as given
    assert with_memory_limit(cluster, 100).device.usable_memory_bytes == 100 * GiB
    with pytest.raises(ShardcError, match=r"--memory-limit must be a positive number of GiB per device, got 0"):
        with_memory_limit(cluster, 0)
    with pytest.raises(ValueError, match="leaves no memory"):
        dataclasses.replace(cluster.device, memory_limit_bytes=None, memory_bytes=GiB)


def test_estimate_fits_against_the_usable_memory() -> None:
    graph = gpt_graph(layers=2, hidden=512, heads=8, vocab=8192, seq=512, batch=4)
    plan = ParallelPlan.parse("mb=4,gbs=4")
    peak = estimate(graph, parse_cluster("1xH100"), plan).memory_per_device_bytes
    # a device whose capacity holds the peak but whose capacity less the headroom does not
    tight = with_overrides(parse_cluster("1xH100"), memory_bytes=int(peak + 1.2 * GiB))
    e = estimate(graph, tight, plan)
    assert e.memory_capacity_bytes > peak > e.memory_limit_bytes and not e.fits
    assert "usable; largest category" in (e.overflow or "")
    data = json.loads(e.to_json())
    assert data["memory_usable_bytes"] == tight.device.usable_memory_bytes and data["fits"] is False
    given = estimate(graph, with_memory_limit(tight, (peak + 1.2 * GiB) / GiB), plan)
    assert given.fits and given.memory_limit_bytes == given.memory_capacity_bytes


def test_estimate_report_shows_the_headroom_and_takes_memory_limit(capsys) -> None:
    args = ["estimate", "examples/gpt.py:tiny", "--cluster", "2xA100-80GB", "--plan", "dp=2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "memory headroom" in out and "5.5 GiB (context 512 MiB, NCCL 1 GiB" in out
    assert "of 74.5 GiB usable" in out
    assert main(args + ["--memory-limit", "0.0001", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory_usable_bytes"] == int(0.0001 * GiB) and data["fits"] is False
    assert data["memory_headroom"] == "not counted: --memory-limit 105 KiB"
    assert main(args + ["--memory-limit", "-1"]) == 2
    assert "--memory-limit must be a positive number of GiB" in capsys.readouterr().err


def test_solver_plans_within_the_usable_memory() -> None:
    spec, cluster = PRESETS["tiny"].spec, parse_cluster("2xH100")
    free_graph, ctx = solve(spec, cluster, 8, time_limit=2)
    free = ctx.options["search"].best.estimate.memory_per_device_bytes
    # capacity above the free plan's peak, usable (20% fragmentation) below it
    device = dataclasses.replace(cluster.device, memory_bytes=int(free * 1.05), headroom=Headroom(fragmentation=0.2))
    tight = dataclasses.replace(cluster, device=device)
    assert device.usable_memory_bytes < free < device.memory_bytes
    graph, ctx = solve(spec, tight, 8, time_limit=2)
    best = ctx.options["search"].best.estimate
    assert best.fits and best.memory_per_device_bytes <= device.usable_memory_bytes
    assert ctx.options["memory_limit"] == device.usable_memory_bytes
    assert print_graph(graph) != print_graph(free_graph)
    # --memory-limit at the capacity gives the free plan back
    _, ctx = solve(spec, tight, 8, time_limit=2, memory_limit_gb=device.memory_bytes / GiB)
    assert ctx.options["search"].best.estimate.memory_per_device_bytes == pytest.approx(free)
