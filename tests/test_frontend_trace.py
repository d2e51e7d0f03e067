"""The torch frontend checked by numbers: for every example model and the transformers models,
the traced IR run by the reference backend reproduces the model's own output, every node is
located, the verifier accepts it and the printed IR parses back to an equal graph."""

from __future__ import annotations

import pytest
import torch

from shardc.backends.reference import model_state, run_graph
from shardc.frontend import coverage, trace_with_state
from shardc.frontend.spec import load_model
from shardc.ir.equality import assert_graphs_equal
from shardc.ir.parser import parse
from shardc.ir.printer import print_graph
from shardc.ops.verifier import verify

EXAMPLES = ["examples/gpt.py:tiny", "examples/gpt.py:tiny?tie=false&bias=false", "examples/llama.py:tiny",
            "examples/bert.py:tiny", "examples/mlp.py:tiny", "examples/mlp.py:tiny?loss=mse"]
HF = ["hf:bert?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&intermediate_size=128&vocab_size=128&seq=16",
      "hf:roberta?num_hidden_layers=1&hidden_size=64&num_attention_heads=4&intermediate_size=128&vocab_size=128&seq=16"]


def _hf_direct(kind: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """GPT2LMHeadModel and LlamaForCausalLM from small configs, random weights, no download."""
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                         use_cache=False)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=160, vocab_size=128,
                                          max_position_embeddings=32, use_cache=False)
        model = transformers.LlamaForCausalLM(config)
    return model, (torch.randint(0, 128, (2, 16)),)


def _output(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out.logits  # type: ignore[attr-defined]


CASES = EXAMPLES + HF + ["transformers:gpt2", "transformers:llama"]


@pytest.fixture(scope="module")
def traced() -> dict[str, tuple]:
    return {}


def _trace(case: str, cache: dict[str, tuple]) -> tuple:
    if case not in cache:
        torch.manual_seed(0)
        if case.startswith("transformers:"):
            model, inputs = _hf_direct(case.split(":")[1])
            name, names = case.split(":")[1], None
        else:
            loaded = load_model(case)
            model, inputs, name, names = loaded.model, loaded.example_inputs, loaded.name, loaded.input_names
        model.eval()
        cache[case] = (model, inputs, trace_with_state(model, inputs, name=name, input_names=names))
    return cache[case]


@pytest.mark.parametrize("case", CASES)
def test_reference_backend_reproduces_model(case: str, traced: dict) -> None:
    model, inputs, result = _trace(case, traced)
    graph = result.graph
    with torch.no_grad():
        want = _output(model(*inputs))
        got = run_graph(graph, inputs, model_state(model, graph, result.constants))
    assert len(got) == 1
    assert got[0].shape == want.shape and got[0].dtype == want.dtype
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
    assert coverage(graph).complete, str(coverage(graph))


@pytest.mark.parametrize("case", CASES)
def test_locations_names_and_round_trip(case: str, traced: dict) -> None:
    model, inputs, result = _trace(case, traced)
    graph = result.graph
    verify(graph)
    assert_graphs_equal(parse(print_graph(graph)), graph)
    params = dict(model.named_parameters())
    assert {p.name for p in graph.params} <= set(params)
    assert graph.param_count() == sum(p.numel() for p in model.parameters())
    assert all(node.location.source.count(":") == 1 for node in graph.nodes), "every node has file:line"
    for node in graph.nodes:  # a linear, embedding or norm sits in a module that owns its weight
        if node.op in ("linear", "embedding", "layer_norm", "rms_norm") and len(node.inputs) > 1:
            weight = params[node.inputs[1].name]
            module = model.get_submodule(node.location.module_path)
            assert any(p is weight for p in module.parameters()), (node, node.inputs[1].name)


def test_gpt_ir_shape() -> None:
    """Module paths, tied weights, explicit attention, the loss and folded shape arithmetic."""
    loaded = load_model("examples/gpt.py:tiny?dropout=0.1&n_layer=2")
    result = trace_with_state(loaded.model, loaded.example_inputs, name=loaded.name, input_names=loaded.input_names)
    graph = result.graph
    assert result.tracer == "fx" and result.constants == {}
    assert [v.name for v in graph.inputs] == ["idx", "targets"]
    assert "lm_head.weight" not in {p.name for p in graph.params}  # tied to wte.weight
    by_path = {n.location.module_path: n for n in graph.nodes}
    assert by_path["blocks.1.attn.qkv"].op == "linear"
    assert by_path["blocks.1.mlp.fc1"].op == "linear"
    assert by_path["lm_head"].inputs[1].name == "wte.weight"
    ops = [n.op for n in graph.nodes]
    assert ops[-1] == "cross_entropy" and ops.count("softmax") == 2 and ops.count("masked_fill") == 2
    assert ops.count("dropout") == 1 + 2 * 3  # embeddings; per block: attention probs, proj, mlp
    scale = [n for n in graph.nodes if n.op == "mul" and "other" in n.attrs]
    assert scale and scale[0].attrs["other"] == pytest.approx(0.25)
    for node in graph.nodes:
        if node.op == "gelu":
            assert node.location.source.startswith("gpt.py:")
