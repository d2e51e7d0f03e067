"""The model spec syntax: file factories with queries, transformers types, and bad specs."""

from __future__ import annotations

import pytest
import torch

from shardc.frontend.spec import load_model, parse_query, parse_value
from shardc.ir.diagnostics import ShardcError


def test_query_values_are_typed() -> None:
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("0.1") == 0.1 and parse_value("1e-5") == 1e-5
    assert parse_value("true") is True and parse_value("False") is False and parse_value("none") is None
    assert parse_value("gelu") == "gelu"
    assert parse_query("a=1&b=x&c=false", "spec") == {"a": 1, "b": "x", "c": False}


def test_file_specs() -> None:
    loaded = load_model("examples/gpt.py:tiny?n_layer=3&dropout=0.1&seq=8&batch=1")
    assert loaded.name == "gpt_tiny" and loaded.input_names == ("idx", "targets")
    assert len(loaded.model.blocks) == 3 and loaded.model.blocks[0].attn.attn_drop.p == 0.1
    assert loaded.example_inputs[0].shape == (1, 8)
    default = load_model("examples/mlp.py")  # no factory: the file's `default`
    assert default.name == "mlp_tiny"
    meta = load_model("examples/llama.py:tiny", device="meta")
    assert next(meta.model.parameters()).device.type == "meta"


def test_hf_spec_builds_offline_with_config_fields_and_shape() -> None:
    pytest.importorskip("transformers")
    loaded = load_model("hf:gpt2?n_layer=2&n_embd=128&seq=64", device="meta")
    config = loaded.model.config
    assert type(loaded.model).__name__ == "GPT2LMHeadModel"
    assert config.n_layer == 2 and config.n_embd == 128 and config.n_embd % config.n_head == 0
    assert loaded.example_inputs[0].shape == (2, 64) and loaded.input_names == ("input_ids",)
    bert = load_model("hf:bert?num_hidden_layers=1&hidden_size=64&batch=3&seq=8", device="meta")
    assert type(bert.model).__name__ == "BertForMaskedLM" and bert.example_inputs[0].shape == (3, 8)
    base = load_model("hf:bert?num_hidden_layers=1&hidden_size=64&task=base", device="meta")
    assert type(base.model).__name__ == "BertModel"


@pytest.mark.parametrize("spec,needle", [
    ("examples/nothere.py:tiny", "does not exist"),
    ("examples/gpt.py:gpt5", "gpt2_small"),  # lists the factories
    ("examples/gpt.py:tiny?n_layers=3", "n_layers"),
    ("examples/gpt.py:tiny?3", "key=value"),
    ("model.txt", "not understood"),
    ("hf:gpt9", "no model type 'gpt9'"),
    ("hf:gpt2?n_layerz=2", "n_layerz"),
    ("hf:gpt2?task=vision", "task=causal"),
    ("missing.onnx", "does not exist"),
])
def test_bad_specs_say_what_and_list_choices(spec: str, needle: str) -> None:
    if spec.startswith("hf:"):
        pytest.importorskip("transformers")
    with pytest.raises(ShardcError) as info:
        load_model(spec, device="meta")
    assert needle in str(info.value)


def test_spec_without_default_factory_lists_factories(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "two.py"
    path.write_text("import torch\n\ndef small():\n    return torch.nn.Linear(2, 2), (torch.ones(1, 2),)\n")
    with pytest.raises(ShardcError) as info:
        load_model(str(path))
    assert "no `default`" in str(info.value) and "small" in str(info.value)
    loaded = load_model(f"{path}:small")
    assert loaded.input_names == ("input",) and isinstance(loaded.example_inputs[0], torch.Tensor)
