"""Checkpoints of `plan.parallelize` modules across plans, on one 4-process gloo group.

GPT (tied embedding and head, fused qkv) trains 2 steps under tp=2 x pp=2 (strided qkv shards,
the tied weight on both pipeline ends), saves model and AdamW state, trains a third step. Then
the checkpoint loads under dp=2 x tp=2 (pp=1, DDP, 2 micro-batches) and under dp=2 x pp=2 with
ZeRO-1 (FSDP2 stage modules): parameters equal the saved ones exactly, and the resumed third
step's loss equals the uninterrupted run's. A plain model's checkpoint loads under tp=2 x pp=2,
the sharded checkpoint loads into the plain model, and a checkpoint of another model is refused
with what differs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_backend_numerics import EPS, LR, batches, build

import shardc
from shardc.backends.torch.checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from shardc.backends.torch.launch import spawn
from shardc.ir.diagnostics import ShardcError

SPEC = "examples/gpt.py:tiny?batch=4"
OTHER = "examples/gpt.py:tiny?batch=4&n_embd=32&n_head=2"


def train_steps(module, data, opt) -> list[float]:
    import torch.distributed as dist

    out = []
    for batch in data:
        loss = module.step(*batch)
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        out.append(float(value) / dist.get_world_size())
    return out


def full_params(compiled, module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in compiled.full_state_dict(module).items()}


def fresh_module(compiled, seed: int, spec: str = SPEC):
    """`compiled.parallelize` of a model with other initial weights, and its AdamW."""
    torch.manual_seed(seed)  # a different init: everything must come from the checkpoint
    model, _, _ = build(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    module = compiled.parallelize(model)
    return module, torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)


def worker(rank: int, world: int, plans: dict, root: str, plain_root: str) -> dict:
    _, inputs, _ = build(SPEC)
    data = batches(inputs)
    out: dict = {}
    a = plans["tp=2,pp=2"]
    model, _, _ = build(SPEC)
    module = a.parallelize(model)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    out["a_losses"] = train_steps(module, data[:2], opt)
    save_checkpoint(root, module, opt, step=2, plan=str(a.plan))
    out["saved"] = full_params(a, module)
    out["a_after"] = train_steps(module, data[2:], opt)
    for key in ("dp=2,tp=2", "dp=2,pp=2,zero=1"):
        module, opt = fresh_module(plans[key], seed=7)
        load_checkpoint(root, module, opt)
        out[key] = (full_params(plans[key], module), train_steps(module, data[2:], opt))
    module, _ = fresh_module(a, seed=9)
    load_checkpoint(plain_root, module)
    out["from_plain"] = full_params(a, module)
    other = plans["other"].parallelize(build(OTHER)[0])
    try:
        load_checkpoint(root, other)
        out["other"] = "loaded"
    except ShardcError as err:
        out["other"] = str(err)
    return out if rank == 0 else {}


def test_parallelized_checkpoints_across_plans_and_the_plain_model(tmp_path: Path) -> None:
    model, inputs, _ = build(SPEC)
    plans = {p: shardc.compile(model, inputs, plan=f"{p},dtype=fp32")  # fp32: exact comparisons
             for p in ("tp=2,pp=2", "dp=2,tp=2", "dp=2,pp=2,zero=1")}
    other, other_inputs, _ = build(OTHER)
    plans["other"] = shardc.compile(other, other_inputs, plan="dp=2,tp=2,dtype=fp32")
    torch.manual_seed(3)
    plain, _, _ = build(SPEC)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(2.0)
    save_checkpoint(tmp_path / "plain", plain, step=0)
    out = spawn(worker, 4, plans, str(tmp_path / "ckpt"), str(tmp_path / "plain"), timeout_s=600)[0]
    saved = out["saved"]
    for key in ("dp=2,tp=2", "dp=2,pp=2,zero=1"):
        state, resumed = out[key]
        for name, value in saved.items():
            assert torch.equal(state[name], value), (key, name)
        # training resumed under another plan continues with the uninterrupted run's loss
        assert resumed == pytest.approx(out["a_after"], rel=1e-5), (key, resumed, out["a_after"])
    want = dict(plain.named_parameters())
    for name, value in want.items():
        assert torch.equal(out["from_plain"][name], value.detach()), name
    # the sharded checkpoint as a full state dict loads into the plain model, tied names included
    full = full_state_dict(tmp_path / "ckpt")
    fresh, _, _ = build(SPEC)
    fresh.load_state_dict(full)
    for name, value in fresh.named_parameters():
        assert torch.equal(value.detach(), saved[name]), name
    load_checkpoint(tmp_path / "ckpt", plain)  # and through load_checkpoint, no process group
    assert torch.equal(plain.wte.weight.detach(), saved["wte.weight"])
    text = out["other"]
    assert "from another model" in text and "blocks.0.attn.qkv.weight: checkpoint shape (192, 64), model shape (96, 32)" in text
