"""Ejected torch code: it runs without shardc on gloo and matches the single-process numbers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from shardc.backends.torch.eject import eject, eject_plan, megatron_plan
from shardc.backends.torch.launch import spawn
from shardc.frontend.spec import load_model

ROOT = Path(__file__).resolve().parents[1]
SPEC = f"{ROOT}/examples/llama.py:tiny?batch=4&seq=8"


def _load(path: str):
    spec = importlib.util.spec_from_file_location("ejected", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _loss(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def reference_losses(path: str, steps: int = 3) -> list[float]:
    """The ejected file's model trained plain on one process, as `ejected_worker` trains each rank."""
    model, (idx, targets) = _load(path).build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        loss = _loss(model, idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def ejected_worker(rank: int, world: int, path: str) -> list[float]:
    import torch.distributed as dist

    ejected = _load(path)
    model, (idx, targets) = ejected.build_model()
    model, mesh = ejected.parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    share = idx.shape[0] // ejected.DP
    part = slice(mesh["dp"].get_local_rank() * share, (mesh["dp"].get_local_rank() + 1) * share)
    losses = []
    for _ in range(3):
        loss = _loss(model, idx[part], targets[part])
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value, group=mesh["dp"].get_group())
        losses.append(value.item() / ejected.DP)
    return losses


def test_ejected_dp_tp_code_runs_on_gloo_and_matches_reference(tmp_path: Path) -> None:
    code = eject("dp=2,tp=2", SPEC)
    assert "shardc" not in code.split('"""', 2)[2]  # no shardc import in the code itself
    assert "ColwiseParallel()" in code and "RowwiseParallel()" in code and "fully_shard(model" in code
    path = tmp_path / "ejected.py"
    path.write_text(code)
    results = spawn(ejected_worker, 4, str(path))
    reference = reference_losses(str(path))
    for losses in results:
        for got, want in zip(losses, reference):
            assert abs(got - want) <= 1e-5 * abs(want), (losses, reference)


def test_eject_lists_what_torch_cannot_say() -> None:
    result = eject_plan("dp=1,tp=2,cp=2,pp=2", "examples/gpt.py:tiny")
    text = "\n".join(result.unsupported)
    assert "fused q/k/v projection" in text  # GPT's qkv linear: interleaved shards
    assert "context parallelism cp=2" in text
    assert "pipeline pp=2" in text
    assert "fused q/k/v" in result.code  # listed in the file's docstring too


def test_megatron_plan_pairs_column_and_row() -> None:
    plan = megatron_plan(load_model("examples/llama.py:tiny", device="meta").model)
    assert plan["blocks.0.attn.wq"] == "colwise" and plan["blocks.0.attn.wo"] == "rowwise"
    assert plan["blocks.1.mlp.w2"] == "rowwise" and "lm_head" not in plan
