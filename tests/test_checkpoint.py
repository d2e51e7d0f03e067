"""Checkpoints of pipelined `plan.parallelize` modules across plans, interrupted saves, bad input.

One 4-process gloo run compiles the GPT example with 4 blocks (tied embedding and head) and
trains it 2 AdamW steps under dp=2 x pp=2 (DDP stage modules, 1F1B), saves model and
optimizer state with the plan and `extra`, and trains 2 more steps. Then the checkpoint loads
under dp=2 x tp=2 (pp=1) and under pp=4 with other initial weights: the step and `extra` come
back, parameters equal the saved ones exactly, and the 2 resumed steps (the second depends on
the loaded Adam moments) have the uninterrupted run's losses. It also loads into a plain model
holding DTensor shards (torch's `parallelize_module` on the MLPs). A plain model's checkpoint loads
under pp=4; the sharded checkpoint loads into the plain model (as a full state dict, tied names
sharing one tensor, and through `load_checkpoint` without a process group).
tests/test_checkpoint_plans.py covers tp x pp, FSDP2 stage modules and the other direction.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_backend_numerics import EPS, LR, build
from test_checkpoint_plans import fresh_module, full_params, train_steps

import shardc
from shardc.backends.torch.checkpoint import (
    full_state_dict,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from shardc.backends.torch.launch import spawn
from shardc.ir.diagnostics import ShardcError

SPEC = "examples/gpt.py:tiny?batch=4&n_layer=4"
SMALL = "examples/gpt.py:tiny?batch=4&n_embd=32&n_head=2"  # 2 blocks, half the width
PLANS = ("dp=2,pp=2", "dp=2,tp=2", "pp=4")
STEPS = 4


def _data(inputs: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1234)
    return [tuple(torch.randint(0, 128, x.shape, generator=g) for x in inputs) for _ in range(STEPS)]


def checkpoint_worker(rank: int, world: int, plans: dict, root: str, plain_root: str) -> dict:
    _, inputs, _ = build(SPEC)
    data = _data(inputs)
    out: dict = {}
    a = plans["dp=2,pp=2"]
    model, _, _ = build(SPEC)
    module = a.parallelize(model)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    train_steps(module, data[:2], opt)
    save_checkpoint(root, module, opt, step=2, plan=str(a.plan), extra={"seed": 0})
    out["saved"] = full_params(a, module)
    out["a_after"] = train_steps(module, data[2:], opt)
    for key in ("dp=2,tp=2", "pp=4"):
        module, opt = fresh_module(plans[key], seed=7, spec=SPEC)
        info = load_checkpoint(root, module, opt)
        out[key] = ((info.step, info.extra, info.plan), full_params(plans[key], module), train_steps(module, data[2:], opt))
    module, _ = fresh_module(plans["pp=4"], seed=9, spec=SPEC)
    load_checkpoint(plain_root, module)
    out["from_plain"] = full_params(plans["pp=4"], module)
    out["dtensor"] = _load_into_dtensor_model(root)
    return out if rank == 0 else {}


def _load_into_dtensor_model(root: str) -> dict[str, torch.Tensor]:
    """The checkpoint into a plain model whose MLPs torch's `parallelize_module` shards over tp=2."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardc.backends.torch.eject import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, _, _ = build(SPEC)
    mlp = {f"blocks.{i}.mlp.{fc}": kind for i in range(4) for fc, kind in (("fc1", "colwise"), ("fc2", "rowwise"))}
    apply_tensor_parallel(model, mesh["tp"], mlp)
    assert hasattr(model.blocks[0].mlp.fc1.weight, "full_tensor")
    load_checkpoint(root, model)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def test_pipelined_checkpoints_across_plans(tmp_path: Path) -> None:
    model, inputs, _ = build(SPEC)
    plans = {p: shardc.compile(model, inputs, plan=f"{p},dtype=fp32") for p in PLANS}  # fp32: exact comparisons
    torch.manual_seed(42)
    plain, _, _ = build(SPEC)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(2.0)
    save_checkpoint(tmp_path / "plain", plain, step=0)
    out = spawn(checkpoint_worker, 4, plans, str(tmp_path / "ckpt"), str(tmp_path / "plain"), timeout_s=600)[0]
    saved = out["saved"]
    full = full_state_dict(tmp_path / "ckpt")
    assert set(full) == set(build(SPEC)[0].state_dict()), set(full)  # parameters, persistent buffers
    assert set(full) - set(saved) == {"lm_head.weight"}, set(full) - set(saved)
    for name in set(full) & set(saved):
        assert torch.equal(full[name], saved[name]), name
    assert full["lm_head.weight"] is full["wte.weight"]  # tied names share one stored tensor
    for key in ("dp=2,tp=2", "pp=4"):
        (step, extra, plan), state, resumed = out[key]
        assert (step, extra, plan) == (2, {"seed": 0}, str(plans["dp=2,pp=2"].plan)), key
        for name, value in saved.items():
            assert torch.equal(state[name], value), (key, name)
        # training resumed under another plan continues with the losses of the run that never stopped
        assert resumed == pytest.approx(out["a_after"], rel=1e-5), (key, resumed, out["a_after"])
    for name, value in out["dtensor"].items():
        assert torch.equal(value, full[name]), ("DTensor shards", name)
    for name, value in plain.named_parameters():
        assert torch.equal(out["from_plain"][name], value.detach()), ("plain -> pp=4", name)
    fresh, _, _ = build(SPEC)
    fresh.load_state_dict(full)  # into the plain unpartitioned model
    other, _, _ = build(SPEC)
    load_checkpoint(tmp_path / "ckpt", other)  # and through load_checkpoint, no process group
    loaded = other.state_dict()
    for name, want in fresh.state_dict().items():
        assert torch.equal(loaded[name], want), name
    assert torch.equal(other.wte.weight.detach(), saved["wte.weight"])


def dying_save_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint.filesystem as fs

    model, _, _ = build(SMALL)
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
    model, _, _ = build(SMALL)
    expected = model.state_dict()
    loaded = full_state_dict(tmp_path)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    # the next save cleans the half-written directory and commits normally
    save_checkpoint(tmp_path, model, step=3)
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    assert not list(tmp_path.glob("*.tmp-*"))


def test_checkpoint_from_another_model_says_what_differs(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, build(SPEC)[0], step=5)
    with pytest.raises(ShardcError) as err:
        load_checkpoint(tmp_path, build(SMALL)[0])
    text = str(err.value)
    assert "from another model" in text and "24 parameters not in the model: blocks.2.attn.proj.bias" in text
    assert "blocks.0.attn.qkv.weight: checkpoint shape (192, 64), model shape (96, 32)" in text
    assert read_manifest(tmp_path)["step"] == 5


def test_missing_checkpoint_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ShardcError, match="no committed checkpoint"):
        load_checkpoint(tmp_path, build(SMALL)[0])
