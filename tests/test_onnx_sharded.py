"""An ONNX model compiled with DP and TP plans on 2 gloo processes matches onnxruntime, and
after a few training steps its parameters, written back to ONNX, run in onnxruntime and give
what single-process training of the same model gives."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

import shardc
from shardc.backends.torch.launch import spawn
from shardc.frontend.onnx import OnnxModule, example_inputs, import_onnx, write_onnx
from shardc.models import load_model

PLANS = ("dp=2", "tp=2")
STEPS = 3
LR = 1e-3


def loss_of(output: torch.Tensor) -> torch.Tensor:
    """A user's loss on the ONNX model's logits (the file has no loss of its own)."""
    return output.float().square().mean()


def _worker(rank: int, world: int, path: str, plans: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for text, plan in plans.items():
        result = import_onnx(path)
        module = plan.parallelize(OnnxModule(result))  # type: ignore[attr-defined]
        inputs = example_inputs(result.graph, seed=7)
        with torch.no_grad():
            logits = module(*inputs)
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR, eps=1e-4)
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss_of(module(*inputs)).backward()
            optimizer.step()
        state = plan.full_state_dict(module)  # type: ignore[attr-defined]
        out[text] = {"logits": logits.detach(), "state": {k: v.detach() for k, v in state.items()}}
    return out


@pytest.fixture(scope="module")
def gpt_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    loaded = load_model("examples/gpt.py:tiny?batch=2", device="cpu")
    loaded.model.eval()
    path = tmp_path_factory.mktemp("onnx") / "gpt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(loaded.model, (loaded.example_inputs[0],), dynamo=True, verbose=False).save(str(path))
    return path


def test_dp_and_tp_plans_match_onnxruntime_and_write_back(gpt_onnx: Path, tmp_path: Path) -> None:
    result = import_onnx(gpt_onnx)
    inputs = example_inputs(result.graph, seed=7)
    plans = {text: shardc.compile(OnnxModule(result), inputs, plan=text) for text in PLANS}
    per_rank = spawn(_worker, 2, str(gpt_onnx), plans, timeout_s=300)

    session = ort.InferenceSession(str(gpt_onnx))
    ref = session.run(None, {result.graph.inputs[0].name: inputs[0].numpy()})[0]
    # The single-process twin of the training loop.
    reference = OnnxModule(import_onnx(gpt_onnx))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, eps=1e-4)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss_of(reference(*inputs)).backward()
        optimizer.step()

    for text in PLANS:
        # dp=2: each rank returns its half of the batch; tp=2: both return the whole output.
        logits = [r[text]["logits"] for r in per_rank]
        ours = torch.cat(logits) if text.startswith("dp") else logits[0]
        np.testing.assert_allclose(ours.numpy(), ref, atol=1e-5, rtol=0, err_msg=text)

        state = per_rank[0][text]["state"]
        for name, value in reference.named_parameters():
            torch.testing.assert_close(state[name], value.detach(), rtol=1e-5, atol=1e-6, msg=f"{text}: {name}")
        trained = tmp_path / f"trained-{text.replace('=', '')}.onnx"
        write_onnx(result, {k: state[k] for k in result.initializer_of}, trained)
        after = ort.InferenceSession(str(trained)).run(None, {result.graph.inputs[0].name: inputs[0].numpy()})[0]
        with torch.no_grad():
            expected = reference(*inputs).numpy()
        np.testing.assert_allclose(after, expected, atol=1e-5, rtol=0, err_msg=text)
