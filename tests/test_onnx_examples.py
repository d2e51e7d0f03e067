"""ONNX files no one here wrote by hand: the GPT and Llama examples exported by
`torch.onnx.export(..., dynamo=True)`, imported, and run against onnxruntime."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from shardc.frontend.onnx import OnnxModule, import_onnx
from shardc.frontend.spec import load_model


def export(spec: str, path: Path) -> Path:
    loaded = load_model(spec, device="cpu")
    loaded.model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(loaded.model, (loaded.example_inputs[0],), dynamo=True, verbose=False)
    program.save(str(path))
    return path


@pytest.fixture(scope="module", params=["examples/gpt.py:tiny", "examples/llama.py:tiny"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = request.param.split("/")[-1].split(".")[0]
    return export(request.param, tmp_path_factory.mktemp("onnx") / f"{name}.onnx")


def test_exported_example_matches_onnxruntime(exported: Path) -> None:
    result = import_onnx(exported)
    graph = result.graph
    assert graph.params and all(p.requires_grad for p in graph.params)
    assert any(n.location.module_path.startswith(("blocks.", "layers.")) for n in graph.nodes)
    module = OnnxModule(result)
    ids = torch.randint(0, 64, graph.inputs[0].type.shape)
    ours = module(ids).detach().numpy()
    ref = ort.InferenceSession(str(exported)).run(None, {graph.inputs[0].name: ids.numpy()})[0]
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


def test_exported_example_loads_through_the_model_syntax(exported: Path) -> None:
    from shardc.frontend import trace

    loaded = load_model(str(exported))
    graph = trace(loaded.model, loaded.example_inputs, name=loaded.name)
    assert graph.param_count() == sum(p.numel() for p in loaded.model.parameters())
