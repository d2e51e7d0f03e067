"""Tracing on the meta device: GPT-3 175B is traced without allocating its weights."""

from __future__ import annotations

import time

import torch

from shardc.frontend import trace_with_state
from shardc.frontend.spec import load_model


def test_gpt3_175b_traces_on_meta_with_its_parameter_count() -> None:
    start = time.perf_counter()
    loaded = load_model("examples/gpt.py:gpt3_175b", device="meta")
    built = time.perf_counter() - start
    result = trace_with_state(loaded.model, loaded.example_inputs, name=loaded.name, input_names=loaded.input_names)
    total = time.perf_counter() - start
    print(f"gpt3_175b on meta: built in {built:.1f} s, traced in {result.seconds:.1f} s "
          f"({len(result.graph.nodes)} nodes, {result.graph.param_count() / 1e9:.2f}B parameters)")
    assert all(p.device.type == "meta" for p in loaded.model.parameters())
    assert abs(result.graph.param_count() - 175e9) / 175e9 < 0.005
    assert result.graph.param_count() == sum(p.numel() for p in loaded.model.parameters())
    assert total < 60
    linears = [n for n in result.graph.nodes if n.op == "linear"]
    assert len(linears) == 4 * 96 + 1
    assert linears[0].outputs[0].type.shape == (1, 2048, 3 * 12288)
    assert any(n.location.module_path == "blocks.95.mlp.fc2" for n in result.graph.nodes)
    assert torch.empty(0).device.type == "cpu"  # the default device is left as it was
