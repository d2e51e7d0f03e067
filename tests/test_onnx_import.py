"""The ONNX frontend: hand-built (onnx.helper) models checked against onnxruntime, and bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from shardc.frontend.onnx import import_onnx, parse_input_shapes, write_onnx
from shardc.ir.diagnostics import ShardcError
from shardc.ops.registry import get_op


def run_ir(graph, inputs, state):
    """Execute the unpartitioned IR with registry impls (the reference backend's rule)."""
    env = {id(v): t for v, t in zip(graph.inputs, inputs)}
    for v in graph.params + graph.buffers:
        env[id(v)] = state[v.name]
    for node in graph.nodes:
        out = get_op(node.op).impl(*[env[id(v)] for v in node.inputs], **node.attrs)
        for v, t in zip(node.outputs, out if isinstance(out, tuple | list) else [out]):
            env[id(v)] = t
    return [env[id(v)] for v in graph.outputs]


def attention_block(batch: int | str = 2, seq: int = 8, hidden: int = 16, heads: int = 2, opset: int = 18):
    """An attention block written directly with onnx.helper: Gemm projections, a causal mask
    applied with Where before Softmax, head reshapes, and a Gemm output projection."""
    rng = np.random.default_rng(0)
    d = hidden // heads

    def init(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.2, name)

    inits = [init("wq", hidden, hidden), init("wk", hidden, hidden), init("wv", hidden, hidden),
             init("bq", hidden), init("wo", hidden, hidden), init("bo", hidden),
             numpy_helper.from_array(np.tril(np.ones((seq, seq), dtype=bool)), "causal"),
             numpy_helper.from_array(np.array([-1, hidden], dtype=np.int64), "flat"),
             numpy_helper.from_array(np.array([batch if isinstance(batch, int) else 2, seq, heads, d], dtype=np.int64), "heads"),
             numpy_helper.from_array(np.array(-1e9, dtype=np.float32), "neg"),
             numpy_helper.from_array(np.array(1.0 / np.sqrt(d), dtype=np.float32), "scale")]
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["x2"], name="flatten_tokens"),
        helper.make_node("Gemm", ["x2", "wq", "bq"], ["q2"], name="q_proj", transB=1),
        helper.make_node("Gemm", ["x2", "wk"], ["k2"], name="k_proj", transB=1),
        helper.make_node("Gemm", ["x2", "wv"], ["v2"], name="v_proj"),
        helper.make_node("Reshape", ["q2", "heads"], ["q3"], name="q_heads"),
        helper.make_node("Reshape", ["k2", "heads"], ["k3"], name="k_heads"),
        helper.make_node("Reshape", ["v2", "heads"], ["v3"], name="v_heads"),
        helper.make_node("Transpose", ["q3"], ["q"], perm=[0, 2, 1, 3], name="q_t"),
        helper.make_node("Transpose", ["k3"], ["kt"], perm=[0, 2, 3, 1], name="k_t"),
        helper.make_node("Transpose", ["v3"], ["v"], perm=[0, 2, 1, 3], name="v_t"),
        helper.make_node("MatMul", ["q", "kt"], ["s0"], name="scores"),
        helper.make_node("Mul", ["s0", "scale"], ["s1"], name="scale_scores"),
        helper.make_node("Where", ["causal", "s1", "neg"], ["s2"], name="mask"),
        helper.make_node("Softmax", ["s2"], ["p"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["p", "v"], ["o0"], name="context"),
        helper.make_node("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3], name="o_t"),
        helper.make_node("Reshape", ["o1", "flat"], ["o2"], name="o_flat"),
        helper.make_node("Gemm", ["o2", "wo", "bo"], ["y"], name="o_proj", transB=1),
        helper.make_node("Tanh", ["y"], ["out"], name="act"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["tokens", hidden])
    graph = helper.make_graph(nodes, "attention", [x], [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


@pytest.fixture()
def attention_file(tmp_path: Path) -> Path:
    path = tmp_path / "attention.onnx"
    onnx.save(attention_block(), path)
    return path


def test_helper_attention_matches_onnxruntime(attention_file: Path) -> None:
    result = import_onnx(attention_file)
    graph = result.graph
    assert {p.name for p in graph.params} == {"wq", "wk", "wv", "bq", "wo", "bo"}
    assert [n.op for n in graph.nodes].count("linear") == 3  # Gemm with transB=1 -> linear
    assert "softmax" in [n.op for n in graph.nodes]
    q_proj = next(n for n in graph.nodes if n.location.source.endswith(":q_proj"))
    assert q_proj.location.source == "attention.onnx:q_proj"
    x = torch.randn(2, 8, 16)
    ours = run_ir(graph, [x], result.state)[0]
    ref = ort.InferenceSession(str(attention_file)).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(ours.detach().numpy(), ref, atol=1e-5, rtol=0)


def test_trained_parameters_written_back(attention_file: Path, tmp_path: Path) -> None:
    result = import_onnx(attention_file)
    trained = {k: v + 0.01 * torch.ones_like(v) for k, v in result.state.items() if k in result.initializer_of}
    out = tmp_path / "trained.onnx"
    write_onnx(result, trained, out)
    x = torch.randn(2, 8, 16)
    ref = ort.InferenceSession(str(out)).run(None, {"x": x.numpy()})[0]
    ours = run_ir(result.graph, [x], {**result.state, **trained})[0]
    np.testing.assert_allclose(ours.detach().numpy(), ref, atol=1e-5, rtol=0)
    assert not list(tmp_path.glob("*.tmp"))


def test_not_onnx_and_truncated_files(tmp_path: Path, attention_file: Path) -> None:
    bogus = tmp_path / "notes.onnx"
    bogus.write_text("this is not a protobuf\n" * 10)
    with pytest.raises(ShardcError, match="is not an ONNX model"):
        import_onnx(bogus)
    data = attention_file.read_bytes()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardcError, match="truncated"):
        import_onnx(truncated)
    with pytest.raises(ShardcError, match="does not exist"):
        import_onnx(tmp_path / "missing.onnx")


def test_old_opset_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.onnx"
    onnx.save(attention_block(opset=13), path)
    with pytest.raises(ShardcError, match=r"opset 13, which is too old.*17 and newer") as err:
        import_onnx(path)
    assert "convert_version" in str(err.value)


def test_dynamic_dims_need_values(tmp_path: Path) -> None:
    path = tmp_path / "dynamic.onnx"
    onnx.save(attention_block(batch="batch"), path)
    with pytest.raises(ShardcError, match=r"input 'x' .* dynamic dimension 'batch' \(dim 0\)") as err:
        import_onnx(path)
    assert "--input-shape x=8x8x16" in str(err.value)
    result = import_onnx(path, input_shapes=parse_input_shapes(["x=2x8x16"]))
    assert result.graph.inputs[0].type.shape == (2, 8, 16)
    with pytest.raises(ShardcError, match="malformed"):
        parse_input_shapes(["x:2x8"])
    with pytest.raises(ShardcError, match="not inputs"):
        import_onnx(path, input_shapes={"y": (2, 8, 16)})


def test_unsupported_op_names_the_node(tmp_path: Path) -> None:
    model = attention_block()
    model.graph.node.append(helper.make_node("Hardmax", ["out"], ["hard"], name="odd_one"))
    model.graph.output[0].name = "hard"
    path = tmp_path / "unsupported.onnx"
    onnx.save(model, path)
    with pytest.raises(ShardcError, match=r"ONNX op Hardmax \(node 'odd_one'.*no registry entry"):
        import_onnx(path)


def test_every_listed_op_matches_onnxruntime(tmp_path: Path) -> None:
    """One graph through every op the issue lists (and shape arithmetic folded at import)."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 4)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((4,)).astype(np.float32), "ln_w"),
             numpy_helper.from_array(rng.standard_normal((4,)).astype(np.float32), "ln_b"),
             numpy_helper.from_array(rng.standard_normal((10, 4)).astype(np.float32), "table"),
             numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
             numpy_helper.from_array(np.array([0], dtype=np.int64), "zero"),
             numpy_helper.from_array(np.array([2], dtype=np.int64), "two"),
             numpy_helper.from_array(np.array([2, 2], dtype=np.int64), "halves"),
             numpy_helper.from_array(np.array([1, 1], dtype=np.int64), "ones"),
             numpy_helper.from_array(np.array([-1], dtype=np.int64), "last")]
    n = helper.make_node
    nodes = [
        n("Gather", ["table", "ids"], ["emb"], axis=0),                     # embedding lookup
        n("MatMul", ["x", "w"], ["h0"]),                                     # [3,5,6]@[6,4]
        n("Add", ["h0", "emb"], ["h1"]),
        n("Constant", [], ["half"], value=numpy_helper.from_array(np.array(0.5, dtype=np.float32))),
        n("Mul", ["h1", "half"], ["h2"]),
        n("Sub", ["h2", "half"], ["h3"]),
        n("Div", ["h3", "half"], ["h4"]),
        n("Pow", ["h4", "two_f"], ["h5"]),
        n("Constant", [], ["two_f"], value=numpy_helper.from_array(np.array(2.0, dtype=np.float32))),
        n("Add", ["h5", "half"], ["h6"]),
        n("Sqrt", ["h6"], ["h7"]),
        n("Erf", ["h7"], ["h8"]),
        n("Tanh", ["h8"], ["h9"]),
        n("Gelu", ["h9"], ["h10"]),
        n("LayerNormalization", ["h10", "ln_w", "ln_b"], ["h11"], axis=-1, epsilon=1e-5),
        n("Softmax", ["h11"], ["h12"], axis=-1),
        n("Shape", ["h12"], ["shape"]),                                      # shape arithmetic, folded
        n("Slice", ["shape", "zero", "two"], ["lead"]),
        n("Concat", ["lead", "halves"], ["new_shape"], axis=0),
        n("Reshape", ["h12", "new_shape"], ["h13"]),                         # [3,5,2,2]
        n("Transpose", ["h13"], ["h14"], perm=[0, 2, 1, 3]),                 # [3,2,5,2]
        n("Split", ["h14", "ones"], ["s0", "s1"], axis=1),
        n("Concat", ["s1", "s0"], ["h15"], axis=1),
        n("Slice", ["h15", "zero", "axis1", "last"], ["h16"]),               # last dim [0:1]
        n("Unsqueeze", ["h16", "zero"], ["h17"]),                            # [1,3,2,5,1]
        n("Expand", ["h17", "expand_to"], ["h18"]),                          # [2,3,2,5,1]
        n("Constant", [], ["expand_to"], value=numpy_helper.from_array(np.array([2, 1, 1, 1, 1], dtype=np.int64))),
        n("ReduceMean", ["h18", "zero"], ["h19"], keepdims=1),               # [1,3,2,5,1]
        n("Squeeze", ["h19", "zero"], ["h20"]),                              # [3,2,5,1]
        n("Greater", ["h20", "half"], ["mask"]),
        n("Where", ["mask", "h20", "half"], ["h21"]),
        n("Cast", ["h21"], ["h22"], to=TensorProto.DOUBLE),
        n("Cast", ["h22"], ["out"], to=TensorProto.FLOAT),
    ]
    # Constants must precede their users in ONNX; move them to the front.
    nodes.sort(key=lambda node: node.op_type != "Constant")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 6]),
              helper.make_tensor_value_info("ids", TensorProto.INT64, [3, 5])]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, 2, 5, 1])
    model = helper.make_model(helper.make_graph(nodes, "every_op", inputs, [out], inits),
                              opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    path = tmp_path / "every_op.onnx"
    onnx.save(model, path)
    result = import_onnx(path)
    ops = {node.op for node in result.graph.nodes}
    assert {"embedding", "matmul", "softmax", "layer_norm", "gelu", "erf", "tanh", "sqrt", "pow", "reshape",
            "permute", "split", "concat", "slice", "expand", "mean", "where", "cast"} <= ops
    assert not any(node.op == "shape" for node in result.graph.nodes)  # folded
    x, ids = torch.randn(3, 5, 6), torch.randint(0, 10, (3, 5))
    ours = run_ir(result.graph, [x, ids], result.state)[0]
    ref = ort.InferenceSession(str(path)).run(None, {"x": x.numpy(), "ids": ids.numpy()})[0]
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-5, rtol=0)
