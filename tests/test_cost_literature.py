"""The cost model against the literature's formulas: Narayanan et al. 2021 (FLOPs per step) and
Korthikanti et al. 2022 (activation bytes per layer). Graphs are `examples/gpt.py` traced on the
meta device and partitioned by apply-plan (`traced.gpt_graph`), what `shardc estimate` prices;
nothing here is fitted. Published end-to-end throughput (Narayanan et al.'s Table 1 among
others) is `tests/test_published_runs.py`'s, on `benchmarks/published_data.py`'s rows."""

from __future__ import annotations

import pytest
from traced import gpt_graph

from shardc.cost import CostContext, estimate, layer_costs
from shardc.hardware import parse_cluster
from shardc.plan.parallel import ParallelPlan


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_flops_per_step_match_narayanan(recompute: str) -> None:
    B, s, l, h, V, a, mb = 16, 2048, 4, 2304, 51200, 24, 4
    g = gpt_graph(layers=l, hidden=h, heads=a, vocab=V, seq=s, batch=mb, recompute=recompute)
    e = estimate(g, parse_cluster("1xA100-80GB"), ParallelPlan.parse(f"mb={mb},gbs={B},recompute={recompute}"))
    no_recompute = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    with_recompute = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert e.model_flops_per_step == pytest.approx(no_recompute, rel=0.01)
    expected = with_recompute if recompute == "full" else no_recompute
    assert e.hardware_flops_per_step == pytest.approx(expected, rel=0.01)


def _block_saved(tp: int, sp: bool, recompute: str, s: int = 2048, b: int = 2, h: int = 4096, a: int = 32) -> float:
    g = gpt_graph(layers=1, hidden=h, heads=a, vocab=1024, seq=s, batch=b, tp=tp, sequence_parallel=sp,
                  dropout=0.1)
    ctx = CostContext.build(g, parse_cluster("8xA100-80GB"), "bf16")
    return layer_costs(ctx, g.layer_nodes("blocks.0"), recompute).saved_bytes


@pytest.mark.parametrize("tp,sp,recompute,formula", [
    (1, False, "none", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    (8, False, "none", lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    (8, True, "none", lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    (8, True, "selective", lambda s, b, h, a, t: s * b * h * 34 / t),
    (4, True, "full", lambda s, b, h, a, t: 2 * s * b * h / t),
])
def test_activation_bytes_match_korthikanti(tp, sp, recompute, formula) -> None:
    s, b, h, a = 2048, 2, 4096, 32
    assert _block_saved(tp, sp, recompute, s, b, h, a) == pytest.approx(formula(s, b, h, a, tp), rel=0.02)
