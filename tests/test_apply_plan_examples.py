"""apply-plan on the traced example models (examples/gpt.py, examples/llama.py): Megatron's
collectives per layer, Korthikanti et al.'s TP traffic, ring attention and the verifier."""

from __future__ import annotations

import copy
from collections import Counter

import pytest

from shardc.analysis.resharding import backward_step, edge_steps
from shardc.frontend import trace
from shardc.frontend.spec import load_model
from shardc.ir import Graph, Partition, TemporalSplit
from shardc.ir.equality import assert_graphs_equal
from shardc.ir.parser import parse
from shardc.ir.printer import print_graph
from shardc.passmanager import run_pipeline


@pytest.fixture(scope="module")
def traced() -> dict[str, Graph]:
    out = {}
    for name in ("gpt", "llama"):
        loaded = load_model(f"examples/{name}.py:tiny")
        out[name] = trace(loaded.model, loaded.example_inputs)
    return out


def planned(traced: dict[str, Graph], model: str, options: str) -> Graph:
    """A copy of the traced model after `apply-plan{options}` (the verifier runs after the pass);
    the printed IR parses back to an equal graph."""
    graph = run_pipeline(copy.deepcopy(traced[model]), f"apply-plan{{{options}}}")
    assert_graphs_equal(parse(print_graph(graph)), graph)
    return graph


def collectives(graph: Graph, *, backward: bool = False) -> Counter[str]:
    """Communicating steps on activations (parameter edges are gradient syncs, counted per step)."""
    params = {p.name for p in graph.params}
    out: Counter[str] = Counter()
    for edge, steps in edge_steps(graph).items():
        if edge.value in params:
            continue
        for s in steps:
            step = backward_step(s, graph.mesh) if backward else s  # type: ignore[arg-type]
            if step is not None and step.communicates:
                out[step.kind] += 1
    return out


def blocks(graph: Graph) -> list[str]:
    return [name for name in graph.layers if name.startswith("blocks.")]


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_tp2_has_two_all_reduces_per_layer(traced: dict[str, Graph], model: str) -> None:
    g = planned(traced, model, "tp=2")
    layers = len(blocks(g))
    assert layers == 2
    # Attention and MLP outputs per layer, plus the vocab-parallel embedding; the LM head is
    # column-parallel and its cross entropy reduces over the vocabulary inside the op.
    assert collectives(g) == Counter({"all_reduce": 2 * layers + 1})
    # Backward: Megatron's f before q/k/v and fc1 of each layer, and before the LM head.
    assert collectives(g, backward=True) == Counter({"all_reduce": 2 * layers + 1})
    head = next(n for n in g.nodes if n.location.module_path == "lm_head")
    assert head.partition == Partition((("tp", "n"),))
    assert g.nodes[-1].op == "cross_entropy" and g.nodes[-1].partition == Partition((("tp", "v"),))


@pytest.mark.parametrize("sp", [0, 1])
def test_korthikanti_tp_traffic_on_gpt(traced: dict[str, Graph], sp: int) -> None:
    # Per layer and micro-batch, each device sends 8*b*s*h*(t-1)/t elements (f32 here) in TP
    # collectives: 2 all-reduces forward and 2 backward, or with SP all-gather/reduce-scatter pairs.
    t, (b, s), h = 2, traced["gpt"].inputs[0].type.shape, 64
    g = planned(traced, "gpt", f"tp={t},sp={sp}")
    params = {p.name for p in g.params}
    for layer in blocks(g):
        members = {v.name for n in g.layer_nodes(layer) for v in n.outputs}
        sent = 0
        for edge, steps in edge_steps(g).items():
            if edge.value in members and edge.value not in params:
                for step in steps:
                    back = backward_step(step, g.mesh)  # type: ignore[arg-type]
                    sent += step.wire_bytes + (back.wire_bytes if back is not None else 0)
        assert sent // 4 == 8 * b * s * h * (t - 1) // t, layer


def test_gpt_fused_qkv_is_a_strided_column_split(traced: dict[str, Graph]) -> None:
    g = planned(traced, "gpt", "dp=2,tp=2")
    qkv = next(n for n in g.nodes if n.location.module_path == "blocks.0.attn.qkv")
    assert str(qkv.partition) == "partition<dp:e0, tp:n/3>"
    assert str(qkv.output.layout) == "{dp:S(0), tp:S(2/3)}"
    split = next(n for n in g.nodes if n.op == "split")
    assert all(str(v.layout) == "{dp:S(0), tp:S(2)}" for v in split.outputs)
    # No collective between the qkv projection and the output projection.
    proj = next(n for n in g.nodes if n.location.module_path == "blocks.0.attn.proj")
    inside = {v.name for n in g.nodes[g.nodes.index(qkv) + 1:g.nodes.index(proj) + 1] for v in n.inputs
              if v.kind == "activation"}
    assert not [e for e in edge_steps(g) if e.value in inside]


def test_llama_ring_attention_and_sequence_parallel(traced: dict[str, Graph]) -> None:
    g = planned(traced, "llama", "tp=2,cp=2,sp=1")
    for attn in (n for n in g.nodes if n.op == "scaled_dot_product_attention"):
        assert attn.partition == Partition((("cp", "s"), ("tp", "g")), (TemporalSplit("t", 2, "cp"),))
    assert str(g.nodes[-1].partition) == "partition<cp:d0/2, tp:v>"  # the flattened loss keeps its shards
    # Per layer an all-gather before the attention and the MLP, a reduce-scatter after each; the
    # LM head's input is gathered, the embedding's partial sum reduce-scattered.
    layers = len(blocks(g))
    assert collectives(g) == Counter({"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers + 1})


def test_pipeline_stages_on_gpt(traced: dict[str, Graph]) -> None:
    g = planned(traced, "gpt", "pp=2,dp=2,gbs=8,mb=1")
    assert {n: layer.annotation.stage for n, layer in g.layers.items()} == {
        "embed": 0, "blocks.0": 0, "blocks.1": 1, "head": 1}
    assert g.attrs["microbatches"] == 4
    cuts = [e for e, steps in edge_steps(g).items() if any(s.kind == "send_recv" for s in steps)]
    assert len(cuts) == 1 and (cuts[0].src_stage, cuts[0].dst_stage) == (0, 1)


def test_transformers_gpt2_conv1d_is_megatron_too() -> None:
    # transformers' GPT2 writes its projections as Conv1D: x @ W + b with W[k, n] a parameter,
    # and splits a fused c_attn through a bias add and a reshape.
    loaded = load_model("hf:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=128&n_positions=32&batch=2&seq=16")
    g = planned({"gpt2": trace(loaded.model, loaded.example_inputs)}, "gpt2", "tp=2")
    c_attn = next(n for n in g.nodes if n.op == "matmul" and n.location.module_path.endswith("0.attn.c_attn"))
    assert str(c_attn.partition) == "partition<tp:n/3>"
    # The model returns the logits: they are gathered over tp at the output.
    assert collectives(g) == Counter({"all_reduce": 2 * 2 + 1, "all_gather": 1})
