"""The hardware catalog and the cluster syntax: preset figures, parse forms, errors, local."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from shardc.calibration.profile import AlphaBeta, CollectiveFit, LocalProfile, write_profile
from shardc.hardware import (
    ALIASES,
    PRESETS,
    Cluster,
    DeviceSpec,
    LinkSpec,
    make_cluster,
    parse_cluster,
)
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import precision

GiB = 1 << 30


def test_preset_figures_match_the_data_sheets() -> None:
    a100 = PRESETS["A100-80GB"].device
    assert a100.peak("bf16") == 312e12 and a100.peak("fp16") == 312e12
    assert a100.peak("fp32") == 19.5e12 and a100.peak("tf32") == 156e12
    assert a100.memory_bytes == 80 * GiB and a100.memory_bandwidth == 2039e9
    assert PRESETS["A100-40GB"].device.memory_bandwidth == 1555e9
    assert PRESETS["A100-40GB"].device.memory_bytes == 40 * GiB
    h100 = PRESETS["H100-SXM"].device
    assert h100.peak("bf16") == 989e12 and h100.peak("fp32") == 67e12 and h100.memory_bandwidth == 3.35e12
    h200 = PRESETS["H200"].device
    assert h200.peak("bf16") == h100.peak("bf16") and h200.memory_bytes == 141 * GiB
    assert h200.memory_bandwidth == 4.8e12
    v100 = PRESETS["V100-32GB"].device
    assert v100.peak("fp16") == 125e12 and v100.peak("fp32") == 15.7e12 and v100.memory_bandwidth == 900e9


def test_links_are_per_direction_per_gpu_bytes_per_second() -> None:
    # NVLink totals (both directions) from the data sheets, halved; IB Gb/s divided by 8.
    assert PRESETS["V100-32GB"].intra.bandwidth == 300e9 / 2
    assert PRESETS["A100-80GB"].intra.bandwidth == 600e9 / 2
    assert PRESETS["H100-SXM"].intra.bandwidth == 900e9 / 2
    assert PRESETS["V100-32GB"].inter.bandwidth == 100e9 / 8
    assert PRESETS["A100-40GB"].inter.bandwidth == 200e9 / 8
    assert PRESETS["H200"].inter.bandwidth == 400e9 / 8
    assert PRESETS["H800"].intra.bandwidth == 400e9 / 2 and PRESETS["H800"].inter.bandwidth == 400e9 / 8
    assert PRESETS["H800"].device.peak("bf16") == 989e12 and PRESETS["H800"].device.peak("fp8") == 1979e12
    for p in PRESETS.values():
        assert p.devices_per_node == 8
        assert 1e-6 <= p.intra.latency < p.inter.latency <= 10e-6
        assert p.intra.effective_bandwidth < p.intra.bandwidth


def test_dtype_spellings_and_missing_dtype() -> None:
    a100 = PRESETS["A100"] if "A100" in PRESETS else PRESETS[ALIASES["A100"]]
    assert a100.device.peak("f32") == a100.device.peak("fp32") == a100.device.peak("float32")
    assert precision("bfloat16") == "bf16" and precision("f16") == "fp16"
    with pytest.raises(ShardcError, match=r"V100-32GB has no peak FLOP/s for dtype 'bf16'; it knows fp16, fp32"):
        PRESETS["V100-32GB"].device.peak("bf16")


def test_matmul_efficiency_curve() -> None:
    dev = PRESETS["A100-80GB"].device
    big = dev.matmul_flops_per_s(1e15, "bf16")
    assert big == pytest.approx(dev.peak("bf16") * dev.matmul_efficiency, rel=1e-5)
    half = dev.matmul_flops_per_s(dev.matmul_half_flops, "bf16")
    assert half == pytest.approx(big / 2, rel=1e-5)


@pytest.mark.parametrize("text, nodes, per_node, device", [
    ("8xA100-80GB", 1, 8, "A100-80GB"),
    ("64xH100", 8, 8, "H100-SXM"),
    ("2x8xH100", 2, 8, "H100-SXM"),
    ("4xA100", 1, 4, "A100-80GB"),
    ("16 x v100", 2, 8, "V100-32GB"),
    ("3x4xH200", 3, 4, "H200"),
    ("8xa100-40gb", 1, 8, "A100-40GB"),
])
def test_parse_cluster_forms(text: str, nodes: int, per_node: int, device: str) -> None:
    c = parse_cluster(text)
    assert (c.nodes, c.devices_per_node, c.device.name) == (nodes, per_node, device)
    assert c.num_devices == nodes * per_node
    assert str(c) == f"{nodes}x{per_node}x{device}"
    assert parse_cluster(str(c)) == c
    assert c.intra == PRESETS[device].intra and c.inter == PRESETS[device].inter


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ShardcError) as err:
        parse_cluster("8xB200")
    msg = str(err.value)
    assert "unknown cluster preset 'B200'" in msg
    for name in ("V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H200", "H100 (= H100-SXM)", "local"):
        assert name in msg


@pytest.mark.parametrize("text, expected", [
    ("A100", r"cannot read cluster 'A100'; write e.g. 8xA100-80GB, 64xH100 \(8 per node\), 2x8xH100"),
    ("8x", r"cannot read cluster '8x'"),
    ("0xH100", r"cluster '0xH100' has no devices"),
    ("12xH100", r"12 devices do not fill nodes of 8; use 8xH100 or 16xH100.*e\.g\. 2x6xH100, 3x4xH100"),
    ("2x4xlocal", r"the local machine is one node; write 8xlocal or local8"),
])
def test_bad_cluster_syntax(text: str, expected: str) -> None:
    with pytest.raises(ShardcError, match=expected):
        parse_cluster(text)


def test_link_levels_by_group() -> None:
    c = make_cluster("H100", 4)
    assert c.link_for(8) is c.intra and c.link_for(1, 8) is c.intra
    assert c.link_for(2, 8) is c.inter and c.link_for(16) is c.inter and c.link_for(4, 2) is c.intra
    assert not c.spans_nodes(1, 1000)


def test_dataclasses_check_themselves() -> None:
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        LinkSpec("x", 0, 1e-6)
    with pytest.raises(ValueError, match="efficiency"):
        LinkSpec("x", 1e9, 1e-6, 1.5)
    with pytest.raises(ValueError, match="peak FLOP/s"):
        DeviceSpec("d", (), 1, 1.0)
    dev = PRESETS["H200"].device
    with pytest.raises(ValueError, match=">= 1 node"):
        Cluster(dev, 0, 8, PRESETS["H200"].intra, PRESETS["H200"].inter)


def _profile() -> LocalProfile:
    fits = tuple(CollectiveFit(op, n, ((64, 1e-4), (1 << 20, 1e-3)), AlphaBeta(1e-4, 1e-9))
                 for n in (2, 4) for op in ("all_reduce", "all_gather"))
    return LocalProfile(1, "now", "test-cpu", 2, 16 * GiB, "x", True, ((256, 5e10),), 1e11, 1e6,
                        (("bf16", 2.0), ("fp16", 0.5)), 2e10, 2e-6, ((2, 5e10, 1e10), (4, 2.5e10, 5e9)), fits)


@contextmanager
def fixed_local_profile(folder: Path, cores: int | None = None) -> Iterator[Path]:
    """`_profile()` as this machine's cached `local` profile in `folder` (SHARDC_CACHE_DIR set while
    inside): tests plan and predict on it without calibrating, so plans do not vary with load.
    `cores`: the machine's core count in place of the profile's 2."""
    profile = _profile() if cores is None else replace(_profile(), cores=cores)
    write_profile(profile, folder / "local-profile.json")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDC_CACHE_DIR", str(folder))
        yield folder


def test_local_cluster_from_the_cached_profile(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))
    write_profile(_profile(), tmp_path / "local-profile.json")
    for text in ("local4", "local:4", "4xlocal"):
        c = parse_cluster(text)
        assert (c.nodes, c.devices_per_node, str(c)) == (1, 4, "local4")
        assert c.device.peak("fp32") == 2.5e10 and c.device.peak("bf16") == 5e10
        assert c.device.memory_bytes == 4 * GiB and c.device.memory_bandwidth == 5e9
        # all_reduce fit alpha=1e-4, beta=1e-9 s/B over 4 ranks as a ring: 6 steps, 1.5x the bytes
        assert c.intra.latency == pytest.approx(1e-4 / 6) and c.intra.bandwidth == pytest.approx(1.5e9)
    assert parse_cluster("local").devices_per_node >= 1
