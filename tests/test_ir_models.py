"""The example models and transformers models through the frontend, group-layers, annotate-cost,
the verifier and a printed round trip; GPT-3 175B verifies quickly."""

from __future__ import annotations

import time

import pytest

from shardc.frontend import trace
from shardc.frontend.spec import load_model
from shardc.ir.equality import assert_graphs_equal
from shardc.ir.parser import parse
from shardc.ir.printer import print_graph
from shardc.ops.verifier import verify
from shardc.passes.annotate_cost import cost_table
from shardc.passmanager import PassContext, run_pipeline

MODELS = [
    "examples/gpt.py:tiny?n_layer=3",
    "examples/llama.py:tiny?n_layer=3",
    "examples/bert.py:tiny",
    "examples/mlp.py:tiny",
    "hf:gpt2?n_layer=2&n_embd=64&n_head=4&seq=16",
    "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
    "&num_key_value_heads=2&seq=16",
]


def traced(spec: str):
    loaded = load_model(spec, device="meta")
    return trace(loaded.model, loaded.example_inputs, name=loaded.name)


@pytest.mark.parametrize("spec", MODELS)
def test_model_groups_costs_verifies_and_round_trips(spec: str) -> None:
    graph = run_pipeline(traced(spec), "group-layers,annotate-cost")  # verified after each pass
    verify(graph)
    assert_graphs_equal(graph, parse(print_graph(graph)))
    assert all(n.layer in graph.layers for n in graph.nodes)
    repeated = [layer for layer in graph.layers.values() if layer.name not in ("embed", "head")]
    assert len(repeated) >= 2
    if not spec.startswith("examples/mlp.py"):  # the MLP's first layer is narrower than the rest
        assert {layer.block for layer in repeated} == {"block0"}, {lay.name: lay.block for lay in repeated}
    rows = cost_table(graph)
    assert sum(r.params for r in rows) == graph.param_count()
    assert sum(r.nodes for r in rows) == len(graph.nodes)
    assert all(r.flops > 0 for r in rows if r.layer not in ("embed",))


def test_gpt_activation_bytes_match_korthikanti() -> None:
    """Per layer, 16-bit activations: s*b*h*(34 + 5*a*s/h) (Korthikanti et al. 2022), plus the
    two layer norms' fp32 mean and rstd (8 bytes per row), which the formula leaves out."""
    s, b, h, a = 16, 2, 64, 4
    graph = traced(f"examples/gpt.py:tiny?n_layer=2&n_embd={h}&n_head={a}&seq={s}&batch={b}&dropout=0.1")
    graph = run_pipeline(graph, "group-layers,annotate-cost{dtype=bf16}")
    rows = {r.layer: r for r in cost_table(graph, dtype="bf16")}
    expected = s * b * h * (34 + 5 * a * s // h) + 2 * 8 * s * b
    assert rows["blocks.0"].saved_bytes == rows["blocks.1"].saved_bytes == expected
    assert sum(n.annotations["saved_bytes"] for n in graph.layer_nodes("blocks.0")) == expected


def test_gpt3_175b_verifies_quickly() -> None:
    graph = traced("examples/gpt.py:gpt3_175b")
    assert len(graph.nodes) > 2500
    verify(graph)  # first run: shape inference of each distinct signature
    start = time.perf_counter()
    verify(graph)
    assert time.perf_counter() - start < 2.0
    ctx = PassContext()
    graph = run_pipeline(graph, "group-layers,annotate-cost", ctx)
    assert all(t.seconds + t.verify_seconds < 5.0 for t in ctx.timings), ctx.timings
    blocks = {layer.block for layer in graph.layers.values()}
    assert blocks == {"embed", "block0", "head"} and len(graph.layers) == 98
    assert abs(graph.param_count() / 175e9 - 1) < 0.005


@pytest.mark.parametrize("plan", ["dp=2,tp=2", "tp=2,sp=true,pp=2", "cp=2,dp=2"])
def test_partitioned_and_lowered_graphs_round_trip(plan: str) -> None:
    """Layouts, partitions, collectives and stages made by apply-plan and lower print, parse
    back equal, and after lowering every operand already has the layout its node needs."""
    graph = run_pipeline(traced("examples/gpt.py:tiny"), f"apply-plan{{{plan}}},annotate-cost,lower")
    verify(graph, check_input_layouts=True)
    assert graph.mesh is not None and any(n.partition is not None for n in graph.nodes)
    assert_graphs_equal(graph, parse(print_graph(graph)))
