"""`estimate` end to end: JSON, fitting, unbalanced stages, plots, bad input, a traced model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from traced import gpt_graph

from shardc.cli import main
from shardc.cost import estimate
from shardc.cost.report import plot
from shardc.driver import estimate as estimate_spec
from shardc.driver import partition
from shardc.hardware import parse_cluster
from shardc.ir import LayerAnnotation
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan


def _small(**kw):
    args = dict(layers=8, hidden=1024, heads=16, vocab=8192, seq=512, batch=4, dp=2, tp=2, pp=2)
    args.update(kw)
    return gpt_graph(**args)


def test_json_has_the_promised_keys_and_categories_sum_to_step() -> None:
    e = estimate(_small(), parse_cluster("8xA100-80GB"), ParallelPlan.parse("dp=2,tp=2,pp=2,mb=2,gbs=32"))
    data = json.loads(e.to_json())
    for key in ("step_time_s", "mfu", "memory_per_device_bytes", "memory_breakdown", "tokens_per_s", "fits"):
        assert key in data
    assert data["memory_per_device_bytes"] == max(s["memory_bytes"] for s in data["stages"])
    for stage in e.stages:
        assert sum(stage.time.values()) == pytest.approx(e.step_time_s)
    assert 0 < e.mfu < 1 and e.fits


def test_unbalanced_stages_show_unbalanced_time_and_memory() -> None:
    cluster, plan = parse_cluster("8xA100-80GB"), ParallelPlan.parse("dp=2,tp=2,pp=2,mb=2,gbs=32")
    balanced = estimate(_small(), cluster, plan)
    g = _small()
    for i in range(8):
        g.layers[f"blocks.{i}"].annotation = LayerAnnotation(stage=0 if i < 6 else 1)
    skewed = estimate(g, cluster, plan)
    mem = [s.memory_bytes for s in skewed.stages]
    assert mem[0] > 1.5 * mem[1]
    assert skewed.stages[0].memory["activations"] > balanced.stages[0].memory["activations"]
    assert skewed.step_time_s > balanced.step_time_s
    assert skewed.stages[1].time["bubble"] > skewed.stages[0].time["bubble"]


def test_a_plan_that_does_not_fit_names_stage_and_category(tmp_path: Path) -> None:
    g = gpt_graph(layers=4, hidden=8192, heads=64, vocab=8192, seq=256, batch=1)
    e = estimate(g, parse_cluster("1xV100-32GB"), ParallelPlan.parse("mb=1,gbs=1,dtype=fp16"))
    assert not e.fits
    assert "stage 0" in e.overflow and "optimizer" in e.overflow
    assert json.loads(e.to_json())["fits"] is False
    plot(e, str(tmp_path / "est.png"))
    assert (tmp_path / "est.png").stat().st_size > 10_000


def test_zero_shards_model_states_and_recompute_trades_memory_for_time() -> None:
    cluster = parse_cluster("8xA100-80GB")
    base = estimate(_small(pp=1, dp=4), cluster, ParallelPlan.parse("dp=4,tp=2,mb=1,gbs=16"))
    zero = estimate(_small(pp=1, dp=4, zero=1), cluster, ParallelPlan.parse("dp=4,tp=2,mb=1,gbs=16,zero=1"))
    assert zero.stages[0].memory["optimizer"] == pytest.approx(base.stages[0].memory["optimizer"] / 4)
    full = estimate(_small(pp=1, dp=4, recompute="full"), cluster,
                    ParallelPlan.parse("dp=4,tp=2,mb=1,gbs=16,recompute=full"))
    assert full.stages[0].memory["activations"] < base.stages[0].memory["activations"] / 5
    assert full.step_time_s > base.step_time_s


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ShardcError, match="A100-80GB"):
        estimate_spec("examples/gpt.py:tiny", "8xB300", "dp=8")


def test_invalid_plan_names_the_constraint() -> None:
    with pytest.raises(ShardcError, match="tp=3 does not divide"):
        estimate_spec("examples/gpt.py:tiny", "6xA100-80GB", "dp=2,tp=3,gbs=4")


def test_traced_gpt_matches_korthikanti_with_sequence_parallelism(tmp_path: Path) -> None:
    s, b, h, a, t = 128, 2, 256, 8, 2
    cluster = parse_cluster("4xA100-80GB")
    plan = ParallelPlan.parse(f"dp=2,tp={t},sp=1,mb={b},gbs={2 * b}")
    graph, _ = partition(f"examples/gpt.py:gpt?n_layer=2&n_embd={h}&n_head={a}&seq={s}&batch={2 * b}"
                         "&dropout=0.1&vocab_size=512", cluster, plan)
    e = estimate(graph, cluster, plan)
    block = next(r for r in e.layer_table if r["layer"].startswith("blocks"))
    assert block["saved_bytes"] == pytest.approx(s * b * h / t * (34 + 5 * a * s / h), rel=0.02)
    out = tmp_path / "e.png"
    assert main(["estimate", "examples/gpt.py:tiny", "--cluster", "4xA100-80GB", "--plan", "dp=2,tp=2,gbs=4",
                 "--plot", str(out)]) == 0
    assert out.exists()
