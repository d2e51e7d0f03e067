"""A transformers decoder exported by torch.onnx (dynamo=True) with its weights in an external
data file: it imports from any working directory (the data file is found beside the model), the
ops the exporter emits (IsNaN guarding attention, and the rest of the long tail, checked against
onnxruntime on a hand-made graph) import as aten fallback nodes, the import
computes what onnxruntime and the torch original compute, and under tp=2 on 2 gloo processes it
trains like the torch original does in one process."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import shardc
from shardc.backends.torch.launch import spawn
from shardc.frontend.onnx import OnnxModule, import_onnx
from shardc.frontend.spec import load_model
from shardc.ir.diagnostics import ShardcError

QWEN2 = ("hf:qwen2?num_hidden_layers=1&hidden_size=64&intermediate_size=128&num_attention_heads=4"
         "&num_key_value_heads=2&vocab_size=128&max_position_embeddings=64&seq=16&batch=2")
STEPS = 3
LR = 1e-3


class Logits(torch.nn.Module):
    """The causal LM's logits: what the ONNX file computes."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(ids).logits


def original() -> tuple[torch.nn.Module, torch.Tensor]:
    """The torch model, seeded. Norm weights and biases are drawn too: the exporter merges
    initializers of equal value (all-ones norms, all-zero biases), which would tie them."""
    torch.manual_seed(0)
    loaded = load_model(QWEN2, device="cpu")
    model = Logits(loaded.model).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in name else p.uniform_(-0.1, 0.1)
    return model, loaded.example_inputs[0]


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.roll(-1, 1).reshape(-1))


def train(module: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, eps=1e-4)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = loss_of(module(ids), ids)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, ids = original()
    path = tmp_path_factory.mktemp("export") / "qwen2.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids,), dynamo=True, verbose=False).save(str(path), external_data=True)
    assert (path.parent / "qwen2.onnx.data").is_file()
    return path


def test_external_data_is_found_beside_the_model_from_another_directory(
        exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing named qwen2.onnx.data here
    result = import_onnx(exported)
    isnan = [n for n in result.graph.nodes if n.op == "aten"]
    assert [n.attrs["target"] for n in isnan] == ["torch.ops.aten.isnan.default"]
    assert isnan[0].location.module_path == "m.model.layers.0.self_attn"
    # Exporter-folded rotary tables and masks are buffers; the (transposed) weights are parameters.
    kinds = {v.name: v.kind for v in result.graph.params + result.graph.buffers}
    assert kinds["m.model.embed_tokens.weight"] == "parameter"
    assert sum(v.type.numel for v in result.graph.params) == sum(
        p.numel() for p in original()[0].parameters())
    assert all(v.type.rank == 4 for v in result.graph.buffers if v.type.is_float)  # cos, sin, mask

    model, ids = original()
    with torch.no_grad():
        ours = OnnxModule(result)(ids)
        want = model(ids)
    ref = ort.InferenceSession(str(exported)).run(None, {result.graph.inputs[0].name: ids.numpy()})[0]
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)
    assert load_model(os.path.relpath(exported, tmp_path)).model is not None  # the spec path too


def test_unoptimised_export_keeps_weights_trainable_behind_their_transposes(tmp_path: Path) -> None:
    """`optimize=False` leaves `Transpose(W)`, `CastLike` and `GatherND` (mask building) in the
    file: the weights stay parameters under their torch names, the rotary `inv_freq` a buffer."""
    model, ids = original()
    path = tmp_path / "raw.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids,), dynamo=True, verbose=False, optimize=False).save(str(path), external_data=True)
    result = import_onnx(path)
    params = {v.name for v in result.graph.params}
    assert params == {name for name, _ in model.named_parameters()}
    assert "m.model.rotary_emb.inv_freq" not in params
    with torch.no_grad():
        torch.testing.assert_close(OnnxModule(result)(ids), model(ids), atol=1e-5, rtol=0)


def test_missing_external_data_names_the_file_and_folder(exported: Path, tmp_path: Path) -> None:
    lonely = tmp_path / "qwen2.onnx"
    lonely.write_bytes(exported.read_bytes())  # the model without its data file
    with pytest.raises(ShardcError) as info:
        import_onnx(lonely)
    assert "qwen2.onnx.data" in str(info.value) and str(tmp_path) in str(info.value)


def _worker(rank: int, world: int, path: str, plan: object, ids: torch.Tensor) -> dict[str, object]:
    torch.use_deterministic_algorithms(True)
    module = plan.parallelize(OnnxModule(import_onnx(path)))  # type: ignore[attr-defined]
    losses = train(module, ids)
    return {"losses": losses, "state": plan.full_state_dict(module)}  # type: ignore[attr-defined]


def test_onnx_export_trains_under_tp2_like_its_torch_original(exported: Path) -> None:
    result = import_onnx(exported)
    model, ids = original()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    plan = shardc.compile(OnnxModule(result), (ids,), plan="tp=2,mb=2,dtype=fp32")  # one micro-batch: the file fixes its batch
    text = plan.partitioned_ir
    assert "{tp:S(" in text  # weights are split, not all replicated
    per_rank = spawn(_worker, 2, str(exported), plan, ids, timeout_s=300)

    torch.use_deterministic_algorithms(True)
    want = train(model, ids)
    assert per_rank[0]["losses"] == pytest.approx(want, rel=1e-5)
    # Every trained ONNX weight is a torch weight (the exporter folds some transposed): compare.
    trained = dict(model.named_parameters())
    assert {v.name for v in result.graph.params} <= set(per_rank[0]["state"])
    for name in (v.name for v in result.graph.params):
        got, start = per_rank[0]["state"][name], result.state[name]
        match = [(k, False) for k, t in initial.items() if t.shape == start.shape and torch.equal(t, start)] + \
                [(k, True) for k, t in initial.items() if t.dim() == 2 and t.T.shape == start.shape
                 and torch.equal(t.T, start)]
        assert match, f"ONNX weight {name} is no torch weight"
        key, transposed = match[0]
        final = trained[key].detach()
        torch.testing.assert_close(got, final.T if transposed else final, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _tail_model(path: Path) -> None:
    """A hand-made ONNX graph of the exporters' long-tail ops, each feeding an output."""
    from onnx import TensorProto, helper, numpy_helper

    def const(name: str, value: np.ndarray) -> Any:
        return numpy_helper.from_array(value, name)

    nodes = [
        helper.make_node("IsNaN", ["x"], ["nan"]), helper.make_node("Where", ["nan", "zero", "x"], ["y0"]),
        helper.make_node("IsInf", ["x"], ["inf"], detect_negative=0), helper.make_node("Cast", ["inf"], ["y1"], to=1),
        helper.make_node("Sign", ["x"], ["s"]), helper.make_node("Floor", ["x"], ["f"]),
        helper.make_node("Ceil", ["x"], ["c"]), helper.make_node("Round", ["x"], ["r"]),
        helper.make_node("Add", ["s", "f"], ["sf"]),
        helper.make_node("Add", ["c", "r"], ["cr"]), helper.make_node("Add", ["sf", "cr"], ["y2"]),
        helper.make_node("Mod", ["x", "three"], ["y3"], fmod=1),
        helper.make_node("Clip", ["x", "lo", "hi"], ["y4"]),
        helper.make_node("Tile", ["x", "reps"], ["y5"]),
        helper.make_node("ArgMax", ["x"], ["y6"], axis=2, keepdims=0),
        helper.make_node("TopK", ["x", "k"], ["y7", "y8"], axis=-1),
        helper.make_node("Pad", ["x", "pads", "half"], ["y9"], mode="constant"),
        helper.make_node("GatherElements", ["x", "picks"], ["y10"], axis=2),
        helper.make_node("Gather", ["x", "idx"], ["y11"], axis=1),
        helper.make_node("CumSum", ["x", "one"], ["y12"]),
        helper.make_node("Softplus", ["x"], ["y13"]),
    ]
    inits = [const("zero", np.array(0.0, np.float32)), const("three", np.array([3.0], np.float32)),
             const("lo", np.array(-0.5, np.float32)), const("hi", np.array(0.5, np.float32)),
             const("reps", np.array([1, 2, 1], np.int64)), const("k", np.array([2], np.int64)),
             const("pads", np.array([0, 1, 0, 0, 2, 1], np.int64)), const("half", np.array(0.5, np.float32)),
             const("picks", np.array([[[0, 5]] * 4] * 2, np.int64)), const("one", np.array(1, np.int64))]
    outs = [("y0", 1, [2, 4, 6]), ("y1", 1, [2, 4, 6]), ("y2", 1, [2, 4, 6]), ("y3", 1, [2, 4, 6]), ("y4", 1, [2, 4, 6]),
            ("y5", 1, [2, 8, 6]), ("y6", 7, [2, 4]), ("y7", 1, [2, 4, 2]), ("y8", 7, [2, 4, 2]), ("y9", 1, [2, 7, 7]),
            ("y10", 1, [2, 4, 2]), ("y11", 1, [2, 3, 6]), ("y12", 1, [2, 4, 6]), ("y13", 1, [2, 4, 6])]
    graph = helper.make_graph(
        nodes, "tail", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 6]),
                        helper.make_tensor_value_info("idx", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())


def test_exporter_tail_ops_import_as_aten_nodes_and_match_onnxruntime(tmp_path: Path) -> None:
    path = tmp_path / "tail.onnx"
    _tail_model(path)
    result = import_onnx(path)
    x = torch.randn(2, 4, 6) * 3
    x[0, 0, 0], x[1, 1, 1] = float("nan"), float("inf")
    idx = torch.tensor([3, 0, 2])
    with torch.no_grad():
        ours = OnnxModule(result)(x, idx)
    want = ort.InferenceSession(str(path)).run(None, {"x": x.numpy(), "idx": idx.numpy()})
    assert len(ours) == len(want) == 14
    for k, (got, ref) in enumerate(zip(ours, want)):
        np.testing.assert_allclose(got.numpy(), ref, atol=1e-6, rtol=1e-6, err_msg=f"y{k}")
