"""PipelineRunner (a plain torch model cut by torch.fx) on real gloo groups: GPipe, 1F1B, interleaved.

Compiled plans are pipelined from the IR instead (tests/test_pipeline_numerics.py); this runner
is the torch-only baseline ejected code mirrors. Its dp (DDP per stage) and tp combinations
(pp=2 x dp=2, pp=4, pp=2 x tp=2) train in tests/test_checkpoint.py.

The reference is one process running the same micro-batches with gradient accumulation (the
step the plan defines), then AdamW. Losses at every step and parameters after 3 steps must
agree within 1e-5 relative. Models have no key bias: its true gradient is exactly zero, and
Adam turns the rounding noise there into full-size steps, which no schedule can reproduce.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardc.backends.torch.launch import spawn
from shardc.backends.torch.pipeline import block_stages, split_stages
from shardc.diagnostics import ShardcError

BATCH, SEQ, VOCAB, STEPS, MICRO = 8, 8, 64, 3, 4


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, self.n_head, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """A GPT-like model with separate q, k, v linears (fits torch's Megatron TP) and a tied head."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 4, tie: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        if tie:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def reference(make: dict, micro: int = MICRO) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: each step accumulates gradients over `micro` micro-batches, then AdamW."""
    torch.manual_seed(0)
    model = TinyLM(**make)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in batches():
        total = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            loss = lm_loss(model(xm), ym)
            loss.backward()
            total += loss.item()
        for p in model.parameters():
            p.grad /= micro
        opt.step()
        opt.zero_grad()
        losses.append(total / micro)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def pipeline_worker(rank: int, world: int, configs: list[dict]) -> list[tuple[list[float], dict]]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardc.backends.torch.eject import apply_tensor_parallel
    from shardc.backends.torch.pipeline import PipelineRunner

    out = []
    for cfg in configs:
        pp, dp, tp = cfg["pp"], cfg.get("dp", 1), cfg.get("tp", 1)
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        torch.manual_seed(0)
        model = TinyLM(**cfg.get("make", {}))
        runner = PipelineRunner(model, mesh, lm_loss, n_microbatches=MICRO // dp, schedule=cfg["schedule"],
                                virtual_stages=cfg.get("vpp", 1), shard_model=apply_tensor_parallel)
        opt = torch.optim.AdamW(runner.parameters(), lr=1e-3)
        dp_rank, share = mesh["dp"].get_local_rank(), BATCH // dp
        losses = []
        for x, y in batches():
            part = slice(dp_rank * share, (dp_rank + 1) * share)
            losses.append(runner.step(x[part], y[part]).item())
            opt.step()
            opt.zero_grad()
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                 for k, v in runner.state_dict().items()}
        out.append((losses, state))
    return out


def check_against_reference(results: list, configs: list[dict]) -> None:
    for i, cfg in enumerate(configs):
        ref_losses, ref_state = reference(cfg.get("make", {}))
        for rank_result in results:
            losses, state = rank_result[i]
            for got, want in zip(losses, ref_losses):
                assert abs(got - want) <= 1e-5 * abs(want), (cfg, losses, ref_losses)
            for name, value in state.items():
                err = ((value - ref_state[name]).abs().max() / ref_state[name].abs().max()).item()
                assert err <= 1e-5, (cfg, name, err)
        covered = set().union(*(r[i][1].keys() for r in results))
        assert covered == set(ref_state), (cfg, set(ref_state) - covered)


def test_split_stages_carry_values_and_keep_names() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    stages = split_stages(model, 2)
    assert block_stages(model, 2) == {"blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1}
    assert "wte.weight" in stages[0].state_dict() and "head.weight" in stages[1].state_dict()
    assert "blocks.2.attn.q.weight" in dict(stages[1].named_parameters())
    x = torch.randint(0, VOCAB, (2, SEQ))
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=0)


def test_more_stages_than_blocks_is_an_error() -> None:
    with pytest.raises(ShardcError, match="5 pipeline stages but only 4 blocks"):
        split_stages(TinyLM(), 5)


def test_pipelines_on_two_processes() -> None:
    configs = [
        {"pp": 2, "schedule": "gpipe", "make": {"tie": False}},
        {"pp": 2, "schedule": "1f1b"},
        {"pp": 2, "schedule": "interleaved", "vpp": 2},
    ]
    check_against_reference(spawn(pipeline_worker, 2, configs), configs)
