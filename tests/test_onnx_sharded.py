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
from shardc.frontend.spec import load_model

PLANS = ("dp=2", "tp=2,mb=2")  # one micro-batch each: this file fixes its batch dim
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
    torch.manual_seed(0)  # the same weights whichever tests ran before (the training test reads its loss curve)
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
    plans = {text: shardc.compile(OnnxModule(result), inputs, plan=f"{text},dtype=fp32") for text in PLANS}  # fp32: exact
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
        trained = tmp_path / f"trained-{text.replace('=', '').replace(',', '-')}.onnx"
        write_onnx(result, {k: state[k] for k in result.initializer_of}, trained)
        after = ort.InferenceSession(str(trained)).run(None, {result.graph.inputs[0].name: inputs[0].numpy()})[0]
        with torch.no_grad():
            expected = reference(*inputs).numpy()
        np.testing.assert_allclose(after, expected, atol=1e-5, rtol=0, err_msg=text)


def _pipeline_worker(rank: int, world: int, path: str, plan: object) -> dict[str, object]:
    result = import_onnx(path, input_shapes={"idx": (2, 16)})
    module = plan.parallelize(OnnxModule(result), loss_fn=lambda out, target: loss_of(out))  # type: ignore[attr-defined]
    inputs = example_inputs(result.graph, seed=7)
    target = torch.zeros(inputs[0].shape[0])
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, eps=1e-4)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses.append(float(module.step(*inputs, target=target)))
        optimizer.step()
    state = plan.full_state_dict(module)  # type: ignore[attr-defined]
    return {"losses": losses, "state": {k: v.detach() for k, v in state.items()}}


@pytest.fixture(scope="module")
def dynamic_gpt_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GPT example exported with a dynamic batch dim, so it imports at any micro-batch."""
    torch.manual_seed(0)  # the same weights whichever tests ran before (the training test reads its loss curve)
    loaded = load_model("examples/gpt.py:tiny?batch=2", device="cpu")
    loaded.model.eval()
    path = tmp_path_factory.mktemp("onnx") / "gpt-dynamic.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(loaded.model, (loaded.example_inputs[0],), dynamo=True, verbose=False,
                          dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},)).save(str(path))
    return path


def test_pipeline_plan_matches_onnxruntime_and_trains_like_one_process(dynamic_gpt_onnx: Path,
                                                                       tmp_path: Path) -> None:
    gpt_onnx = dynamic_gpt_onnx
    result = import_onnx(gpt_onnx, input_shapes={"idx": (2, 16)})
    inputs = example_inputs(result.graph, seed=7)
    plan = shardc.compile(OnnxModule(result), inputs, plan="pp=2,dtype=fp32")  # 2 micro-batches of one
    per_rank = spawn(_pipeline_worker, 2, str(gpt_onnx), plan, timeout_s=300)

    logits = ort.InferenceSession(str(gpt_onnx)).run(None, {result.graph.inputs[0].name: inputs[0].numpy()})[0]
    reference = OnnxModule(import_onnx(gpt_onnx, input_shapes={"idx": (2, 16)}))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, eps=1e-4)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = loss_of(reference(*inputs))
        losses.append(float(loss))
        loss.backward()
        optimizer.step()
    # The first loss is computed from the untrained weights: onnxruntime's logits give it too.
    assert per_rank[0]["losses"][0] == pytest.approx(float(np.square(logits).mean()), rel=1e-5)
    for rank in per_rank:
        assert rank["losses"] == pytest.approx(losses, rel=1e-5)
    state = per_rank[0]["state"]
    for name, value in reference.named_parameters():
        torch.testing.assert_close(state[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)
    trained = tmp_path / "trained-pp2.onnx"
    write_onnx(result, {k: state[k] for k in result.initializer_of}, trained)
    after = ort.InferenceSession(str(trained)).run(None, {result.graph.inputs[0].name: inputs[0].numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(after, reference(*inputs).numpy(), atol=1e-5, rtol=0)


def test_micro_batches_of_a_file_with_a_fixed_batch_are_refused(gpt_onnx: Path) -> None:
    result = import_onnx(gpt_onnx)
    with pytest.raises(shardc.ShardcError, match=r"fixes dim 0 to 2; it cannot be given as 1") as err:
        shardc.compile(OnnxModule(result), example_inputs(result.graph), plan="tp=2,dtype=fp32")  # 2 micro-batches
    assert "dynamic_shapes" in str(err.value)


def test_shardc_run_trains_an_onnx_file_on_its_default_loss(gpt_onnx: Path) -> None:
    """`shardc run model.onnx`: logits over token ids train on next-token cross entropy. The
    synthetic batches are uniformly random tokens, which no model can learn: the loss stays about
    log(vocab) (it does not fall step by step); the numerics are checked against onnxruntime and
    one process above."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "shardc.cli", "run", str(gpt_onnx), "--nproc", "2", "--steps", "3",
                           "--plan", "dp=2", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    losses = report["losses"]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert losses == pytest.approx([np.log(128)] * 3, rel=0.05)  # random tokens: about log(vocab)
