"""The example models: presets have their published sizes, factories follow the default device,
overrides reach the config, and forward gives logits or the loss."""

from __future__ import annotations

import pytest
import torch

from shardc.frontend.spec import load_model

SIZES = [  # spec, parameters (published or computed), relative tolerance
    ("examples/gpt.py:gpt2_small", 124.44e6, 0.001),
    ("examples/gpt.py:gpt2_medium", 354.8e6, 0.005),
    ("examples/gpt.py:gpt2_xl", 1.558e9, 0.005),
    ("examples/gpt.py:gpt3_175b", 175e9, 0.005),
    ("examples/llama.py:llama_7b", 6.738e9, 0.002),
    ("examples/llama.py:llama_13b", 13.016e9, 0.002),
    ("examples/llama.py:llama_70b", 68.98e9, 0.002),
    ("examples/bert.py:bert_base", 110e6, 0.01),
    ("examples/bert.py:bert_large", 336e6, 0.01),
]


@pytest.mark.parametrize("spec,params,tol", SIZES)
def test_presets_have_their_sizes_on_meta(spec: str, params: float, tol: float) -> None:
    loaded = load_model(spec, device="meta")
    count = sum(p.numel() for p in loaded.model.parameters())
    assert abs(count - params) / params < tol, f"{spec}: {count:,}"
    assert all(t.device.type == "meta" for t in loaded.example_inputs)


def test_llama_70b_uses_grouped_query_attention() -> None:
    model = load_model("examples/llama.py:llama_70b?n_layer=1", device="meta").model
    attn = model.blocks[0].attn
    assert attn.wk.weight.shape == (8 * 128, 8192) and attn.wq.weight.shape == (8192, 8192)


@pytest.mark.parametrize("name", ["gpt", "llama", "bert", "mlp"])
def test_tiny_models_give_loss_and_outputs(name: str) -> None:
    torch.manual_seed(0)
    loaded = load_model(f"examples/{name}.py:tiny")
    model, inputs = loaded.model, loaded.example_inputs
    loss = model(*inputs)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    out = model(*inputs[:-1])
    assert out.shape[0] == inputs[0].shape[0]
    assert loaded.input_names[-1] in ("targets", "labels")


def test_factories_follow_the_default_device_and_overrides() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_example_for_test", "examples/gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    with torch.device("meta"):
        model, (idx, targets) = module.tiny(batch=3, seq=8, dropout=0.1, tie=False)
    assert idx.device.type == "meta" and idx.shape == (3, 8) and targets.shape == (3, 8)
    assert model.blocks[0].attn.attn_drop.p == 0.1
    assert model.lm_head.weight is not model.wte.weight
    tied, _ = module.tiny()
    assert tied.lm_head.weight is tied.wte.weight
    assert next(tied.parameters()).device.type == "cpu"
    gpt = module.gpt(n_layer=1, n_embd=32, n_head=2, vocab_size=64, seq=4, batch=1, targets=False)
    assert len(gpt[1]) == 1
