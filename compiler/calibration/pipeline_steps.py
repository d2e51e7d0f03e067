"""The pipeline runtime's own CPU work: what torch.distributed.pipelining spends per schedule action.

Why: the cost model prices a stage's ops; torch's schedule runtime adds its own Python around
every action it runs (the stage's forward or backward call with its argument checks and output
bookkeeping, posting and waiting for the activation's send and receive), and a zero-bubble
schedule's split backward walks the stage's autograd graph in Python once per parameter
(`torch.distributed.pipelining._backward.get_param_groups`) and runs one `autograd.grad` per
parameter group for the weights. On this machine, one process per core (`pipeline_schedules.py
--measure --pp 2`, the same stage work under every schedule), each rank's main-thread CPU per
step was 84.7 ms under 1F1B (8 actions), 87.8 under interleaved 1F1B (16), 88.4 under DualPipeV
(16, few of them split) and 94.7 under ZB-V and interleaved zero bubble (24, every backward
split): a schedule's own work, which none of the op costs holds.

Rule: `nprocs` processes form one pipeline of tiny stages (`LINEARS` bias-free linear layers of
`WIDTH` features each: `LINEARS` parameter tensors and microseconds of compute per op) and run
`MICRO_BATCHES` micro-batches per step under torch's Schedule1F1B (a stage per rank: 2m actions
per rank and step) and ScheduleZBVZeroBubble (two stages per rank; forward, input- and weight-
gradient passes: 6m actions and 2m split backwards per rank), alternating with the same stages'
forwards and backwards run plainly by autograd (the ops without the runtime). Per step each
rank's main-thread CPU time (`time.thread_time`), the plain run's subtracted; the median over
steps, the slowest rank's. Then one action costs 1F1B's extra over 2m, and a split backward costs
(ZB-V's extra - 6m actions) / 2m, per parameter tensor of the stage: `LINEARS` of them here.

An action also costs by size (`action_by_size`): the same 1F1B run on a tiny stage and on a block-
sized one (`ACTION_WIDTH` features over `ACTION_TOKENS` rows) gives CPU per byte the stage holds
(weights and saved activations per micro-batch), up to the larger stage's bytes. Where processes
outnumber cores it is most of an action's cost: an action finds its stage's data cold after another
process ran on the core (pp=4 on this machine's 2 cores: rank 0 spent 0.58 ms more per extra action
of a vpp=2 schedule, where the tiny stage read 83 us).

A split backward also costs by size (`split_refill`, one process, about a second in `shardc
calibrate`'s single-process part): it keeps the stage's autograd graph and the gradients it captured
for the weight pass alive while it runs, so what it allocates lands on pages glibc had returned to
the system (page faults and cold caches; a plain backward reuses what it frees as it goes: a GPT
block of 256 features over 128 tokens, alone, faults ~350 pages per split backward and none per
plain one). Measured as CPU per byte the stage saves for backward, from the same stage at two widths.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

WIDTH = 16
LINEARS = 8
MICRO_BATCHES = 8
STEPS = 7
WARMUP = 2
# The second stage size of `action_by_size`: a block's worth of bytes (the study's GPT blocks, 256
# features over 128 tokens, hold 3 MiB of weights and save about 4 MiB per micro-batch)
ACTION_WIDTH = 256
ACTION_TOKENS = 128


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def stage_bytes(width: int = WIDTH, tokens: int = 1) -> float:
    """Bytes a measured stage holds as `runtime_cpu.action_bytes` counts them: its weights and
    what it saves per micro-batch (each linear's input), fp32."""
    return 4.0 * LINEARS * (width * width + tokens * width)


def action_by_size(nprocs: int, steps: int = STEPS) -> tuple[float, float, float, float]:
    """(CPU s per action on the tiny stage, on a block-sized one, the two stages' bytes): where the
    processes outnumber the cores, an action finds its stage's weights and activations cold after
    another process ran on the core, so it costs more on a bigger stage (this machine, 4 processes
    on 2 cores: about 0.17 ms on the tiny stage, 0.4-0.5 ms on 256 features over 128 tokens, where
    2 processes read 0.22 and 0.30). 1F1B only (the split backward's terms are the tiny run's)."""
    small = pipeline_overhead(nprocs, steps, split=False)[0]
    large = pipeline_overhead(nprocs, steps, ACTION_WIDTH, ACTION_TOKENS, split=False)[0]
    return small, large, stage_bytes(), stage_bytes(ACTION_WIDTH, ACTION_TOKENS)


def pipeline_overhead(nprocs: int, steps: int = STEPS, width: int = WIDTH, tokens: int = 1,
                      split: bool = True) -> tuple[float, float]:
    """(CPU seconds per schedule action, CPU seconds per parameter tensor of a split backward),
    measured by every rank of the default gloo group of `nprocs` processes over `steps` steps of
    each schedule (module rule), on stages of `LINEARS` linears of `width` features over `tokens`
    rows per micro-batch; without `split`, 1F1B only (the second figure 0)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleZBVZeroBubble

    rank, p, m = dist.get_rank(), nprocs, MICRO_BATCHES
    torch.manual_seed(0)
    x, target = torch.randn(m * tokens, width), torch.randn(m * tokens, width)
    example = torch.empty(tokens, width, device="meta").requires_grad_(True)  # a stage's input and output: need gradients
    first = torch.empty(tokens, width, device="meta")  # the data: no gradient

    def loss(out: Any, tgt: Any) -> Any:
        return (out - tgt).square().mean()

    def build(ids: list[int], total: int) -> tuple[list[Any], list[Any]]:
        mods = [nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(LINEARS))) for _ in ids]
        stages = [PipelineStage(mod, s, total, torch.device("cpu"), input_args=(example if s > 0 else first,),
                                output_args=(example,)) for mod, s in zip(mods, ids)]
        return mods, stages

    one_ids, vee_ids = [rank], [rank, 2 * p - 1 - rank]
    one_mods, one_stages = build(one_ids, p)
    schedules: dict[str, tuple[Any, list[Any], list[int], int]] = {
        "1f1b": (Schedule1F1B(one_stages[0], m, loss_fn=loss, scale_grads=False), one_mods, one_ids, p)}
    if split:
        vee_mods, vee_stages = build(vee_ids, 2 * p)
        schedules["zbv"] = (ScheduleZBVZeroBubble(vee_stages, m, loss_fn=loss, scale_grads=False), vee_mods, vee_ids,
                            2 * p)

    def scheduled(name: str) -> Callable[[], None]:
        schedule, _, ids, total = schedules[name]
        args = (x,) if 0 in ids else ()
        kwargs = {"target": target} if total - 1 in ids else {}
        return lambda: schedule.step(*args, **kwargs)

    def plain(name: str) -> Callable[[], None]:
        _, mods, ids, total = schedules[name]

        def run() -> None:
            for j in range(m):
                for mod, s in zip(mods, ids):
                    rows = slice(j * tokens, (j + 1) * tokens)
                    out = mod(x[rows].detach().requires_grad_(s > 0))
                    (loss(out, target[rows]) if s == total - 1 else out.sum()).backward()
        return run

    extra: dict[str, list[float]] = {name: [] for name in schedules}
    for step in range(WARMUP + steps):
        for name in schedules:
            dist.barrier()
            ran = _timed(scheduled(name))
            alone = _timed(plain(name))
            for mod in schedules[name][1]:
                mod.zero_grad(set_to_none=True)
            if step >= WARMUP:
                extra[name].append(ran - alone)
    mine = torch.tensor([statistics.median(extra[name]) for name in schedules], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    action = max(0.0, mine[0].item() / (2 * m))
    walk = max(0.0, (mine[1].item() - 6 * m * action) / (2 * m * LINEARS)) if split else 0.0
    return action, walk


# The refill measurement's stage (`split_refill`): `REFILL_BLOCKS` pre-norm MLP blocks over `REFILL_TOKENS`
# tokens, at `REFILL_WIDTH` features and again at `TINY_WIDTH` (the same graph and parameter tensors with
# almost no bytes: what the split costs regardless of size cancels out).
REFILL_WIDTH = 256
TINY_WIDTH = 8
REFILL_TOKENS = 128
REFILL_BLOCKS = 2
REFILL_REPS = 12


def _split_extra(width: int, reps: int) -> tuple[float, float]:
    """(CPU seconds a split backward takes beyond the plain backward of the same stage, median over
    `reps` alternating pairs; bytes the stage saves for backward), for the refill stage at `width`."""
    import torch
    from torch import nn
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: Any) -> Any:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    stage = nn.Sequential(*(Block() for _ in range(REFILL_BLOCKS)))
    params = list(stage.parameters())
    x0 = torch.randn(1, REFILL_TOKENS, width)
    kept: dict[int, int] = {}

    def pack(t: Any) -> Any:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x0.clone().requires_grad_(True))
    weights = {p.untyped_storage().data_ptr() for p in params}
    saved = float(sum(b for ptr, b in kept.items() if ptr not in weights))
    def plain(x: Any, out: Any, grad: Any) -> None:
        out.backward(grad)

    def split(x: Any, out: Any, grad: Any) -> None:
        _, groups = stage_backward_input([out], [grad], [x], iter(params))
        stage_backward_weight(iter(params), groups)

    def timed(backward: Callable[[Any, Any, Any], None]) -> float:
        x = x0.clone().requires_grad_(True)
        out = stage(x)
        grad = torch.ones_like(out)
        return _timed(lambda: backward(x, out, grad))

    extra = []
    for _ in range(reps):
        extra.append(-timed(plain) + timed(split))
        for p in params:
            p.grad = None
    return statistics.median(extra[1:]), saved


def split_refill(reps: int = REFILL_REPS) -> float:
    """CPU seconds per byte a stage saves for backward that torch's split backward
    (`stage_backward_input`, then `stage_backward_weight`) costs beyond the plain backward, on one
    process at one intra-op thread: the split keeps the autograd graph and the captured gradients
    alive, so what it allocates meets pages the allocator had given back (page faults, cold
    caches; a plain backward reuses the memory it frees as it goes). Measured on the refill stage
    at two widths: the difference of the extras over the difference of the saved bytes."""
    big, big_bytes = _split_extra(REFILL_WIDTH, reps)
    tiny, tiny_bytes = _split_extra(TINY_WIDTH, reps)
    return max(0.0, (big - tiny) / max(1.0, big_bytes - tiny_bytes))
