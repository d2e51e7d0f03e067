"""The plan syntax, its defaults and validation, and model dimensions read off the IR."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardc.analysis.dims import ModelDims, model_dims
from shardc.ir import Graph, Layer, Location, Node, TensorType, Value
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import OPTIONAL_KEYS, PLAN_KEYS, ParallelPlan, plan_keys_help, validate_plan

EXAMPLE = "dp=8,tp=8,pp=16,vpp=3,mb=1,gbs=1536,schedule=1f1b,recompute=full,sp=1,cp=1,zero=1,dtype=bf16"


def test_parse_print_round_trip() -> None:
    plan = ParallelPlan.parse(EXAMPLE)
    assert (plan.dp, plan.tp, plan.pp, plan.vpp, plan.mb, plan.gbs) == (8, 8, 16, 3, 1, 1536)
    assert (plan.recompute, plan.sp, plan.zero, plan.dtype) == ("full", True, 1, "bf16")
    assert plan.schedule == "interleaved"  # vpp > 1 with 1f1b is interleaved 1F1B
    assert str(plan) == ("dp=8,tp=8,pp=16,vpp=3,cp=1,sp=1,mb=1,gbs=1536,schedule=interleaved,"
                         "recompute=full,zero=1,dtype=bf16")
    assert ParallelPlan.parse(str(plan)) == plan
    for text in ("", "dp=2,gbs=auto", "tp=4,sp=on,dtype=float16,recompute=Selective", "pp=4,schedule=gpipe,zero=3"):
        p = ParallelPlan.parse(text)
        assert ParallelPlan.parse(str(p)) == p and str(ParallelPlan.parse(str(p))) == str(p)


def test_defaults_are_documented() -> None:
    plan = ParallelPlan.parse("")
    assert plan == ParallelPlan()
    assert str(plan) == ("dp=1,tp=1,pp=1,vpp=1,cp=1,sp=0,mb=1,gbs=auto,schedule=1f1b,recompute=none,"
                         "zero=0,dtype=bf16")
    # Every key is printed, in order, but the optional ones at their default (`OPTIONAL_KEYS`).
    assert [k for k in PLAN_KEYS if k not in OPTIONAL_KEYS] == [part.split("=")[0] for part in str(plan).split(",")]
    assert all(f"{k}={PLAN_KEYS[k][1]}" in (ParallelPlan.__doc__ or "") for k in OPTIONAL_KEYS)
    for part in str(plan).split(","):  # PLAN_KEYS' default column is the printed default
        key, value = part.split("=")
        assert PLAN_KEYS[key][1] == value
        assert f"{key}={value}" in (ParallelPlan.__doc__ or "")


def test_replace_keeps_the_schedule_consistent() -> None:
    plan = ParallelPlan.parse("pp=4,vpp=2")
    assert replace(plan, vpp=1).schedule == "1f1b" and replace(plan, vpp=3).schedule == "interleaved"
    assert replace(ParallelPlan.parse("pp=4"), vpp=2).schedule == "interleaved"


def test_keys_help_lists_every_key() -> None:
    text = plan_keys_help()
    assert len(text.splitlines()) == len(PLAN_KEYS)
    assert "schedule=gpipe|1f1b|interleaved" in text and "(default 1f1b)" in text


def test_helpers() -> None:
    plan = ParallelPlan.parse("dp=4,tp=2,pp=2,cp=2,mb=2,gbs=64,dtype=fp16")
    assert plan.devices == 32 and plan.stages == 2 and plan.ir_dtype == "f16"
    assert plan.micro_batches() == 8
    assert ParallelPlan.parse("dp=4,mb=2").micro_batches(16) == 2
    with pytest.raises(ShardcError, match="gbs=auto and no model batch"):
        ParallelPlan.parse("dp=4").micro_batches()
    with pytest.raises(ShardcError, match=r"global batch 10 is not divisible by dp\*mb = 4\*2 = 8; nearest valid gbs: 8 and 16"):
        ParallelPlan.parse("dp=4,mb=2").micro_batches(10)
    assert ParallelPlan.parse("sp=1").notes() == ["sp=1 has no effect with tp=1 (sequence parallelism shards across tp ranks)"]
    notes = ParallelPlan.parse("pp=4,vpp=2,gbs=6").notes(layers=10)
    assert any("10 layers do not divide evenly into 8 stages" in n for n in notes)
    assert "interleaved 1F1B wants the micro-batch count (6) to be a multiple of pp=4" in notes
    assert any("never fills" in n for n in ParallelPlan.parse("pp=4,gbs=2").notes())


@pytest.mark.parametrize("text, expected", [
    ("dp=8,foo=1", r"unknown plan key 'foo'.*known keys: dp, tp, pp, vpp, cp, sp, mb, gbs, schedule, recompute, recompute_layers, zero, dtype"),
    ("dp=x", r"plan key dp='x': expected an integer >= 1"),
    ("tp=0", r"plan key tp='0': expected an integer >= 1"),
    ("gbs=-3", r"plan key gbs='-3': expected an integer >= 1"),
    ("schedule=pipedream", r"plan key schedule='pipedream': valid values are gpipe, 1f1b, interleaved"),
    ("recompute=some", r"plan key recompute='some': valid values are none, selective, full"),
    ("zero=4", r"plan key zero='4': valid values are 0, 1, 2, 3"),
    ("dtype=int8", r"plan key dtype='int8': valid values are fp32, bf16, fp16"),
    ("sp=2", r"plan key sp='2': expected 0 or 1"),
    ("dp", r"plan key 'dp' has no value"),
    ("dp=2,dp=4", r"plan key 'dp' given twice"),
    ("vpp=2", r"vpp=2 with pp=1"),
    ("pp=2,vpp=2,schedule=gpipe", r"vpp=2 with schedule=gpipe"),
    ("pp=2,schedule=interleaved", r"schedule=interleaved with vpp=1; set vpp>=2"),
])
def test_bad_plan_values(text: str, expected: str) -> None:
    with pytest.raises(ShardcError, match=expected):
        ParallelPlan.parse(text)


def _check(plan: str, **dims: int) -> str:
    with pytest.raises(ShardcError) as err:
        validate_plan(ParallelPlan.parse(plan), **dims)  # type: ignore[arg-type]
    return str(err.value)


def test_validation_errors_name_the_nearest_valid_values() -> None:
    gpt = {"layers": 24, "heads": 16, "hidden": 1024}
    msg = _check("dp=8,tp=8,pp=16", devices=512, layers=128, heads=160, hidden=25600)
    assert "dp*tp*pp*cp = 8*8*16*1 = 1024 but the cluster has 512 devices; to fit, change one degree: dp=4 or tp=4 or pp=8" in msg
    msg = _check("dp=3,tp=2", devices=8, **gpt)
    assert "= 6 but the cluster has 8 devices; to fit, change one degree: dp=4\n" in msg + "\n"
    msg = _check("dp=3,tp=3", devices=8, layers=24, heads=24, hidden=48)
    assert "= 9 but the cluster has 8 devices; the degrees must multiply to 8" in msg
    msg = _check("tp=3,dp=1", devices=3, layers=24, heads=160, hidden=25600, kv_heads=8)
    assert "tp=3 does not divide heads=160 and kv_heads=8 and hidden=25600; valid tp: 1, 2" in msg
    msg = _check("tp=16", devices=16, layers=24, heads=32, hidden=4096, kv_heads=8)
    assert "tp=16 does not divide kv_heads=8; valid tp: 1, 2, 4, 8" in msg
    msg = _check("dp=2,pp=32", devices=64, **gpt)
    assert "pp=32 stages for 24 layers: each stage needs at least one layer, so pp <= 24" in msg
    assert "pp dividing the layers evenly: 3, 4, 6, 8, 12, 24" in msg
    msg = _check("dp=2,pp=8,vpp=4", devices=16, **gpt)
    assert "pp*vpp = 8*4 = 32 stages for 24 layers" in msg and "so pp <= 6" in msg and "with pp=8, vpp <= 3" in msg
    msg = _check("dp=8,mb=3,gbs=1000", devices=8, **gpt)
    assert ("global batch 1000 not divisible by dp*mb = 8*3 = 24 (micro-batch count must be whole); "
            "nearest valid gbs: 984 and 1008; with gbs=1000, valid mb: 1, 5, 25, 125") in msg
    msg = _check("dp=8,mb=3", devices=8, batch=64, **gpt)
    assert "global batch 64 not divisible by dp*mb" in msg and "nearest valid gbs: 48 and 72" in msg
    msg = _check("dp=2,cp=3", devices=6, seq=1000, **gpt)
    assert "cp=3 does not divide the sequence length 1000; valid cp: 1, 2, 4, 5" in msg
    msg = _check("dp=2,tp=4,sp=1", devices=8, seq=1002, **gpt)
    assert "sp=1 splits the sequence 1002 over tp*cp = 4 ranks" in msg
    # several problems at once are all reported
    msg = _check("dp=3,tp=3,gbs=10", devices=8, **gpt)
    assert msg.count("\n  - ") == 3


def test_valid_plans_pass() -> None:
    validate_plan(ParallelPlan.parse(EXAMPLE), devices=1024, layers=96, heads=96, hidden=12288,
                  batch=None, seq=2048, vocab=51200)
    validate_plan(ParallelPlan.parse("dp=2,tp=4,sp=1,cp=2"), devices=16, layers=2, heads=8, hidden=64,
                  kv_heads=4, batch=8, seq=64)
    validate_plan(ParallelPlan.parse("pp=4"), devices=4, layers=6, heads=None, hidden=None)  # uneven: a note


# ---- model_dims on hand-built graphs --------------------------------------------------------

def _v(name: str, shape: list[int], kind: str = "activation", dtype: str = "f32") -> Value:
    return Value(name, TensorType(tuple(shape), dtype), kind)


def _node(g: Graph, op: str, ins: list[Value], out: list[int], path: str, layer: str | None = None) -> Value:
    v = _v(f"x{len(g.nodes)}", out)
    g.nodes.append(Node(op, ins, [v], location=Location(path), layer=layer))
    return v


def _gpt(layers: int = 3) -> Graph:
    g = Graph("gpt")
    idx, targets = _v("idx", [2, 16], "input", "i64"), _v("targets", [2, 16], "input", "i64")
    wte, wpe = _v("wte.weight", [100, 32], "parameter"), _v("wpe.weight", [64, 32], "parameter")
    g.inputs, g.params = [idx, targets], [wte, wpe]
    pos = _v("pos", [16], "buffer", "i64")
    g.buffers = [pos]
    x = _node(g, "embedding", [pos, wpe], [16, 32], "wpe")
    x = _node(g, "embedding", [idx, wte], [2, 16, 32], "wte")
    for i in range(layers):
        ln = _v(f"blocks.{i}.ln.weight", [32], "parameter")
        h = _node(g, "layer_norm", [x, ln], [2, 16, 32], f"blocks.{i}.ln")
        q, k = _node(g, "reshape", [h], [2, 4, 16, 8], f"blocks.{i}.attn"), _node(g, "reshape", [h], [2, 2, 16, 8], f"blocks.{i}.attn")
        a = _node(g, "scaled_dot_product_attention", [q, k, k], [2, 4, 16, 8], f"blocks.{i}.attn")
        x = _node(g, "reshape", [a], [2, 16, 32], f"blocks.{i}.attn")
    logits = _node(g, "linear", [x, wte], [2, 16, 100], "lm_head")
    g.outputs = [_node(g, "cross_entropy", [logits, targets], [], "")]
    return g


def test_model_dims_from_fused_attention() -> None:
    dims = model_dims(_gpt())
    assert dims == ModelDims(layers=3, heads=4, kv_heads=2, hidden=32, vocab=100, seq=16, batch=2)
    validate_plan(ParallelPlan.parse("dp=2,tp=2"), devices=4, **dims.as_kwargs())  # type: ignore[arg-type]
    with pytest.raises(ShardcError, match="tp=4 does not divide kv_heads=2; valid tp: 1, 2"):
        validate_plan(ParallelPlan.parse("tp=4"), devices=4, **dims.as_kwargs())  # type: ignore[arg-type]


def test_kv_heads_behind_repeat_kv() -> None:
    # transformers' repeat_kv: k[b,2,s,d] -> [b,2,1,s,d] -> expand [b,2,2,s,d] -> reshape [b,4,s,d]
    g = _gpt(layers=1)
    sdpa = next(n for n in g.nodes if n.op == "scaled_dot_product_attention")
    k = sdpa.inputs[1]
    k5 = _node(g, "reshape", [k], [2, 2, 1, 16, 8], "blocks.0.attn")
    k5 = _node(g, "expand", [k5], [2, 2, 2, 16, 8], "blocks.0.attn")
    k4 = _node(g, "reshape", [k5], [2, 4, 16, 8], "blocks.0.attn")
    sdpa.inputs[1] = sdpa.inputs[2] = k4
    assert model_dims(g).kv_heads == 2 and model_dims(g).heads == 4


def test_model_dims_from_explicit_attention_and_layer_annotations() -> None:
    g = Graph("bert")
    ids = _v("ids", [4, 8], "input", "i64")
    emb = _v("emb.weight", [50, 24], "parameter")
    g.inputs, g.params = [ids], [emb]
    x = _node(g, "embedding", [ids, emb], [4, 8, 24], "emb")
    for i in range(2):
        name = f"layer{i}"  # no index in the path: the layer annotation decides
        g.layers[name] = Layer(name, "block0")
        w = _v(f"{name}.norm.weight", [24], "parameter")
        x = _node(g, "rms_norm", [x, w], [4, 8, 24], f"{name}.norm", name)
        s = _node(g, "matmul", [x, x], [4, 6, 8, 8], f"{name}.attn", name)
        _node(g, "softmax", [s], [4, 6, 8, 8], f"{name}.attn", name)
    assert model_dims(g) == ModelDims(layers=2, heads=6, kv_heads=6, hidden=24, vocab=50, seq=8, batch=4)


def test_model_dims_without_attention() -> None:
    g = Graph("mlp")
    x = _v("x", [8, 16], "input")
    g.inputs = [x]
    for i in range(3):
        g.layers[f"layers.{i}"] = Layer(f"layers.{i}", "block0")
        w = _v(f"layers.{i}.weight", [16, 16], "parameter")
        x = _node(g, "linear", [x, w], [8, 16], f"layers.{i}", f"layers.{i}")
    g.layers["head"] = Layer("head", "head")
    dims = model_dims(g)
    assert (dims.layers, dims.heads, dims.hidden, dims.vocab) == (3, None, None, None)
    validate_plan(ParallelPlan.parse("tp=2,pp=3"), devices=6, **dims.as_kwargs())  # type: ignore[arg-type]


def test_model_dims_on_traced_models() -> None:
    from shardc.frontend import trace
    from shardc.frontend.spec import load_model

    expected = {
        "examples/gpt.py:tiny": ModelDims(2, 4, 4, 64, 128, 16, 2),
        "examples/llama.py:tiny": ModelDims(2, 4, 2, 64, 128, 16, 2),
    }
    for spec, dims in expected.items():
        m = load_model(spec, device="meta")
        assert model_dims(trace(m.model, m.example_inputs, name=m.name, input_names=m.input_names)) == dims, spec
