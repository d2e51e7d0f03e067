"""Checkpoints across plans on real gloo process groups, interrupted saves, and bad input.

One 4-process run trains under pp=2 x dp=2, saves, trains on; then loads that checkpoint under
tp=2 x dp=2 and pp=4 (and a plain-model checkpoint under pp=2 x tp=2) and checks parameters
and the resumed losses. Parameters must be identical (exact) after a round trip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_pipeline import BATCH, MICRO, TinyLM, batches, lm_loss

from shardc.backends.torch.checkpoint import (
    full_state_dict,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from shardc.backends.torch.launch import spawn
from shardc.diagnostics import ShardcError


def _full(state: dict) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _pipeline(mesh, model):
    from shardc.backends.torch.eject import apply_tensor_parallel
    from shardc.backends.torch.pipeline import PipelineRunner

    return PipelineRunner(model, mesh, lm_loss, n_microbatches=MICRO // mesh["dp"].size(), schedule="1f1b",
                          shard_model=apply_tensor_parallel)


def _train(runner_or_model, mesh, opt, steps) -> list[float]:
    from shardc.backends.torch.pipeline import PipelineRunner, average_gradients

    dp = mesh["dp"].size()
    dp_rank, share = mesh["dp"].get_local_rank(), BATCH // dp
    losses = []
    for x, y in steps:
        part = slice(dp_rank * share, (dp_rank + 1) * share)
        if isinstance(runner_or_model, PipelineRunner):
            loss = runner_or_model.step(x[part], y[part])
        else:  # plain or tensor-parallel model: same micro-batches, gradients averaged over dp
            total = torch.zeros(())
            for xm, ym in zip(x[part].chunk(MICRO // dp), y[part].chunk(MICRO // dp)):
                micro_loss = lm_loss(runner_or_model(xm), ym) / (MICRO // dp)
                micro_loss.backward()
                total += micro_loss.detach()
            if dp > 1:
                average_gradients(list(runner_or_model.parameters()), mesh["dp"].get_group())
                torch.distributed.all_reduce(total, group=mesh["dp"].get_group())
                total /= dp
            loss = total
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def checkpoint_worker(rank: int, world: int, root: str, plain_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from shardc.backends.torch.eject import apply_tensor_parallel

    data = batches(steps=4)
    out: dict = {}
    # plan A: pp=2 x dp=2, two steps, save, one more step
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(0)
    runner = _pipeline(mesh, TinyLM())
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-3)
    out["a_losses"] = _train(runner, mesh, opt, data[:2])
    save_checkpoint(root, runner, opt, step=2, plan="pp=2,dp=2", extra={"seed": 0})
    out["a_saved"] = _full(runner.state_dict())
    out["a_after"] = _train(runner, mesh, opt, data[2:])
    # plan B: tp=2 x dp=2 (DTensor shards), resume from step 2
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    model = apply_tensor_parallel(TinyLM(), mesh["tp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    info = load_checkpoint(root, model, opt)
    out["b_step"], out["b_extra"] = info.step, info.extra
    out["b_loaded"] = _full(model.state_dict())
    out["b_after"] = _train(model, mesh, opt, data[2:])
    # plan C: pp=4
    mesh = init_device_mesh("cpu", (4, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(7)
    runner = _pipeline(mesh, TinyLM())
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-3)
    load_checkpoint(root, runner, opt)
    out["c_loaded"] = _full(runner.state_dict())
    out["c_after"] = _train(runner, mesh, opt, data[2:])
    # unpartitioned -> sharded: a plain model's checkpoint under pp=2 x tp=2
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(9)
    runner = _pipeline(mesh, TinyLM())
    load_checkpoint(plain_root, runner)
    out["d_loaded"] = _full(runner.state_dict())
    return out


def test_checkpoints_across_plans(tmp_path: Path) -> None:
    torch.manual_seed(42)
    plain = TinyLM()
    save_checkpoint(tmp_path / "plain", plain, step=0)
    results = spawn(checkpoint_worker, 4, str(tmp_path / "ckpt"), str(tmp_path / "plain"))
    saved: dict[str, torch.Tensor] = {}
    for r in results:
        saved.update(r["a_saved"])
    full = full_state_dict(tmp_path / "ckpt")
    for name, value in saved.items():
        assert torch.equal(full[name], value), name
    assert torch.equal(full["head.weight"], full["wte.weight"])  # tied names share one tensor
    fresh = TinyLM()
    fresh.load_state_dict(full)  # into the plain unpartitioned model
    for r in results:
        assert r["b_step"] == 2 and r["b_extra"] == {"seed": 0}
        for name, value in r["b_loaded"].items():
            assert torch.equal(value, saved[name]), ("tp=2 x dp=2", name)
        for name, value in r["c_loaded"].items():
            assert torch.equal(value, saved[name]), ("pp=4", name)
        for name, value in r["d_loaded"].items():
            assert torch.equal(value, plain.state_dict()[name]), ("plain -> pp=2 x tp=2", name)
        # resumed training (under other plans) continues with the losses of the run that never stopped
        for got, want in zip(r["b_after"] + r["c_after"], results[0]["a_after"] * 2):
            assert abs(got - want) <= 1e-5 * abs(want), (r["b_after"], r["c_after"], results[0]["a_after"])
    # and the plain model loads it with load_checkpoint too (no process group)
    other = TinyLM()
    load_checkpoint(tmp_path / "ckpt", other)
    for name, value in other.state_dict().items():
        assert torch.equal(value, full[name])


def dying_save_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint.filesystem as fs

    torch.manual_seed(0)
    model = TinyLM()
    save_checkpoint(root, model, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if rank == 1:
        original = fs._write_item

        def write_then_die(*args, **kwargs):
            original(*args, **kwargs)
            os._exit(17)  # killed mid-write: after part of its shard is on disk

        fs._write_item = write_then_die
    save_checkpoint(root, model, step=2)


def test_interrupted_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ShardcError, match="rank 1 died"):
        spawn(dying_save_worker, 2, str(tmp_path), timeout_s=120, pg_timeout_s=20)
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    torch.manual_seed(0)
    expected = TinyLM().state_dict()
    loaded = full_state_dict(tmp_path)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value)
    # the next save cleans the half-written directory and commits normally
    save_checkpoint(tmp_path, TinyLM(), step=3)
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    assert not list(tmp_path.glob("*.tmp-*"))


def test_checkpoint_from_another_model_says_what_differs(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, TinyLM(layers=4), step=5)
    with pytest.raises(ShardcError) as err:
        load_checkpoint(tmp_path, TinyLM(layers=2, d=16))
    text = str(err.value)
    assert "from another model" in text and "26 parameters not in the model: blocks.2.attn.k.weight" in text
    assert "blocks.0.attn.k.weight: checkpoint shape (32, 32), model shape (16, 16)" in text
    assert read_manifest(tmp_path)["step"] == 5


def test_missing_checkpoint_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ShardcError, match="no committed checkpoint"):
        load_checkpoint(tmp_path, TinyLM())
