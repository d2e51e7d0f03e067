"""`hf:` specs of encoder-decoders and with labels: the inputs they give and the loss the model
computes on them, traced and run by the reference backend like transformers runs them."""

from __future__ import annotations

import pytest
import torch

from shardc.backends.reference import model_state, run_graph
from shardc.frontend import trace_with_state
from shardc.frontend.spec import load_model
from shardc.ir.diagnostics import ShardcError

T5 = "hf:t5?num_layers=1&num_decoder_layers=1&d_model=32&d_kv=8&num_heads=4&d_ff=64&vocab_size=64&dropout_rate=0"


def test_an_encoder_decoder_gets_decoder_ids_and_its_generation_head() -> None:
    loaded = load_model(f"{T5}&batch=2&seq=6&decoder_seq=4", device="meta")
    assert type(loaded.model).__name__ == "T5ForConditionalGeneration"
    assert loaded.input_names == ("input_ids", "decoder_input_ids")
    assert [tuple(x.shape) for x in loaded.example_inputs] == [(2, 6), (2, 4)]


def test_labels_make_the_model_return_its_own_loss_which_the_graph_computes() -> None:
    torch.manual_seed(0)
    loaded = load_model(f"{T5}&batch=2&seq=6&labels=true", device="cpu")
    ids, decoder_ids, labels = loaded.example_inputs
    assert loaded.input_names == ("input_ids", "decoder_input_ids", "labels")
    assert torch.equal(labels, decoder_ids)
    model = loaded.model
    result = trace_with_state(model, loaded.example_inputs, name=loaded.name, input_names=loaded.input_names)
    assert [v.name for v in result.graph.inputs] == ["input_ids", "decoder_input_ids", "labels"]
    assert result.graph.outputs[0].type.rank == 0  # the loss comes first
    state = model_state(model, result.graph, result.constants)
    got = run_graph(result.graph, list(loaded.example_inputs), state)[0]
    want = model(*loaded.example_inputs).loss  # the class keeps transformers' name and paths
    assert type(model).__name__ == "T5ForConditionalGeneration"
    assert {n for n, _ in model.named_parameters()} >= {"shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"}
    torch.testing.assert_close(got, want)


def test_a_causal_lm_with_labels_takes_ids_and_labels() -> None:
    loaded = load_model("hf:gpt2?n_layer=1&n_embd=32&n_head=2&vocab_size=64&seq=8&labels=true", device="meta")
    assert loaded.input_names == ("input_ids", "labels")
    assert type(loaded.model).__name__ == "GPT2LMHeadModel"


@pytest.mark.parametrize("query, message", [
    ("labels=yes", "labels='yes'; write labels=true"),
    ("decoder_seq=4", "decoder_seq is for encoder-decoder models; gpt2 is not one"),
    ("task=seq2seq", "gpt2 has no seq2seq head"),
])
def test_bad_hf_keys_are_named(query: str, message: str) -> None:
    with pytest.raises(ShardcError, match=message.replace("(", r"\(")):
        load_model(f"hf:gpt2?n_layer=1&n_embd=32&n_head=2&{query}", device="meta")
