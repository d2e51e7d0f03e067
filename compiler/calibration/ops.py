"""Microbenchmarks of eager training per op class: the `EagerCosts` of the calibrated local CPU.

What runs the model on a CPU is eager PyTorch: each IR node is one call of its registry impl
(`OpDef.impl`), with a Python call, a dispatch and an autograd node around its kernel, and the
optimizer is a Python loop over parameter tensors. On small models that overhead is as large
as the kernels, so a roofline misses half the step. Here each op class (`cost.compute.op_class`;
a few ops that differ from their class by several times get their own fit) is timed through a
representative registry op at a few sizes, forward and autograd backward, in one process with
one intra-op thread (as the study and the gloo tests run), and fitted to `time = call + units *
per_unit` (`fit.fit_affine`, relative error): units are FLOPs for matmuls and the forward's bytes
(`cost.compute.class_bytes`) for the rest, the units the cost model charges with.

- Times are this thread's CPU time (`time.thread_time`): a busy machine does not inflate them.
  They are costs on a core of one's own; how much of a core a process gets is the sharing
  model's business (`hardware.local_cluster`). Each sample is followed by a call of the speed
  probe (`shardc.calibration.speed`) and the medians are taken to its reference speed: the core's own speed
  flips between modes 1.45x apart within seconds on this machine.
- Each timed call starts with cold caches (`timing.evict` overwrites 32 MiB first): in a training step
  every op runs once after the others have used the caches, and a hot loop underprices it
  (by 1.3-2x on the GPT example's ops here).
- A backward is timed with `torch.autograd.grad`, less the engine's fixed cost per backward call
  (a chain of views gives it), so what is left is per node; its fit weighs errors relative to
  the whole measured call, so a small difference cannot dominate.
- Views: a chain of reshapes, their call and their autograd node. Gradient accumulation into a
  parameter's kept `.grad`: `Tensor.backward` less `autograd.grad` of a weight-only linear.
- The optimizer: AdamW's per-tensor loop (`foreach=False`, what torch picks on CPU) with
  `zero_grad(set_to_none=False)`, fitted to `tensors * per_tensor + elements * per_element`
  (the same on FSDP2's DTensor parameters is measured by `calibrate_gloo`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from shardc.calibration.fit import fit_affine, fit_two_terms
from shardc.calibration.profile import EagerCosts, KernelFit
from shardc.calibration.speed import SpeedIndex
from shardc.calibration.timing import COLD_BYTES, evict, timed
from shardc.cost.compute import class_bytes
from shardc.ops.registry import get_op

# class -> (registry op, attrs); each is built at a size by `_inputs`
REPRESENTATIVE: dict[str, tuple[str, dict[str, Any]]] = {
    "elementwise": ("add", {}),
    "transcendental": ("gelu", {}),
    "norm": ("layer_norm", {}),
    "softmax": ("softmax", {"dim": -1}),
    "reduction": ("sum", {"dim": (-1,)}),
    "index": ("embedding", {}),
    "loss": ("cross_entropy", {}),
    "dropout": ("dropout", {"p": 0.1}),
    # Ops whose cost differs from their class's representative by several times, fitted on their own:
    "masked_fill": ("masked_fill", {"value": -1e9}),  # a broadcast, strided mask (attention's causal one)
    "mul": ("mul", {"other": 0.5}),  # by a scalar: its backward is a kernel, add's is none
}
WIDTH = 128  # the last dim of every vector op's input (a hidden size)


def _inputs(kind: str, numel: int) -> list[Any]:
    """Inputs of the class's representative op with about `numel` elements per activation."""
    import torch

    rows = max(1, numel // WIDTH)
    x = torch.randn(rows, WIDTH, requires_grad=True)
    if kind == "elementwise":
        return [x, torch.randn(rows, WIDTH, requires_grad=True)]
    if kind == "norm":
        return [x, torch.ones(WIDTH, requires_grad=True), torch.zeros(WIDTH, requires_grad=True)]
    if kind == "index":
        return [torch.randint(0, 512, (rows,)), torch.randn(512, WIDTH, requires_grad=True)]
    if kind == "masked_fill":
        blocks = max(1, numel // 4096)
        # The mask as GPT-style models slice it from a registered (block, block) buffer: strided.
        return [torch.randn(blocks, 64, 64, requires_grad=True), (torch.rand(1, 256, 256) > 0.5)[:, :64, :64]]
    if kind == "loss":
        return [torch.randn(max(1, numel // 512), 512, requires_grad=True), torch.randint(0, 512, (max(1, numel // 512),))]
    return [x]


def _fwd_bwd(fn: Callable[[], Any], wrt: Sequence[Any], budget: float, speed: SpeedIndex | None = None
             ) -> tuple[float, float]:
    """Seconds of `fn()` under autograd and of `torch.autograd.grad` of its output w.r.t. `wrt`,
    each started with cold caches (`evict`)."""
    import torch

    out = fn()
    grad = torch.ones_like(out)
    buffer = torch.zeros(COLD_BYTES // 4)

    def run() -> tuple[float, float]:
        evict(buffer)
        t0 = time.thread_time()
        y = fn()
        t1 = time.thread_time()
        evict(buffer)
        t2 = time.thread_time()
        torch.autograd.grad(y, wrt, grad)
        return t1 - t0, time.thread_time() - t2

    return timed(run, budget, speed)


def accumulate_fit(budget: float, sizes: Sequence[int] = (16384, 262144), speed: SpeedIndex | None = None
                   ) -> KernelFit:
    """A parameter's gradient accumulation in backward (autograd's AccumulateGrad adding into the
    `.grad` that `zero_grad(set_to_none=False)` kept), per parameter tensor and byte: a weight-only
    `linear` backward by `Tensor.backward` (which accumulates) less the same by `autograd.grad`
    (which does not). Charged as a backward cost (`bwd_call`, `bwd_per_unit`)."""
    import torch

    units, diffs, raw = [], [], []
    for numel in sizes:
        w = torch.randn(numel // WIDTH, WIDTH, requires_grad=True)
        w.grad = torch.zeros_like(w)
        x = torch.randn(64, WIDTH)
        g = torch.ones(64, numel // WIDTH)

        def run(accumulate: bool, w: Any = w, x: Any = x, g: Any = g) -> tuple[float, float]:
            y = torch.nn.functional.linear(x, w)
            t0 = time.thread_time()
            if accumulate:
                y.backward(g)
            else:
                torch.autograd.grad(y, [w], g)
            return time.thread_time() - t0, 0.0

        with_grad, without = timed(partial(run, True), budget, speed)[0], timed(partial(run, False), budget, speed)[0]
        units.append(float(w.nbytes))
        diffs.append(max(with_grad - without, 0.0))
        raw.append(with_grad)
    fit = fit_affine(units, diffs, raw)
    return KernelFit(0.0, 0.0, fit.alpha, fit.beta)


def view_costs(budget: float, chain: int = 16, speed: SpeedIndex | None = None) -> tuple[KernelFit, float]:
    """(the view class's fit, the autograd engine's fixed cost per backward call): a chain of
    `chain` reshapes, and a single one, timed forward and backward."""
    import torch

    reshape = get_op("reshape").impl
    x = torch.randn(64, WIDTH, requires_grad=True)

    def chained(k: int) -> Callable[[], Any]:
        def fn() -> Any:
            y = x
            for i in range(k):
                y = reshape(y, (64 * WIDTH,) if i % 2 == 0 else (64, WIDTH))
            return y
        return fn

    f1, b1 = _fwd_bwd(chained(1), [x], budget, speed)
    fk, bk = _fwd_bwd(chained(chain), [x], budget, speed)
    per_bwd = max(0.0, (bk - b1) / (chain - 1))
    return KernelFit(fk / chain, 0.0, per_bwd, 0.0), max(0.0, b1 - per_bwd)


def kernel_fit(kind: str, sizes: Sequence[int], budget: float, engine: float, speed: SpeedIndex | None = None
               ) -> KernelFit:
    """The class's representative op timed at `sizes` (elements) and fitted (module doc)."""
    name, attrs = REPRESENTATIVE[kind]
    op = get_op(name)
    units, fwd, bwd, raw = [], [], [], []
    for numel in sizes:
        ins = _inputs(kind, numel)
        out = op.impl(*ins, **attrs)
        units.append(class_bytes(kind, [float(t.nbytes) for t in ins], float(out.nbytes)))
        f, b = _fwd_bwd(partial(op.impl, *ins, **attrs), [t for t in ins if t.requires_grad], budget, speed)
        fwd.append(f)
        bwd.append(max(b - engine, 0.0))
        raw.append(b)
    ff, fb = fit_affine(units, fwd), fit_affine(units, bwd, raw)
    return KernelFit(ff.alpha, ff.beta, fb.alpha, fb.beta)


LINEAR_SHAPES = ((256, 128, 128), (512, 128, 512), (512, 512, 128), (1024, 256, 512))  # (m, k, n)
ATTENTION_SHAPES = ((2, 64, 4, 32), (8, 64, 4, 32), (8, 128, 8, 32))  # (batch, seq, heads, head dim)
Case = tuple[Callable[[], Any], list[Any], float]


def linear_cases(quick: bool) -> list[Case]:
    """`linear` (x @ w.T + b, every input needing a gradient) at `LINEAR_SHAPES`, with FLOPs; x is
    (m / 64, 64, k), a transformer's (batch, sequence, hidden) activation (3-D costs more than 2-D)."""
    import torch

    linear = get_op("linear").impl
    cases: list[Case] = []
    for m, k, n in LINEAR_SHAPES[:3] if quick else LINEAR_SHAPES:
        x, w, b = (torch.randn(m // 64, 64, k, requires_grad=True), torch.randn(n, k, requires_grad=True),
                   torch.randn(n, requires_grad=True))
        cases.append((partial(linear, x, w, b), [x, w, b], 2.0 * m * k * n + m * n))
    return cases


def attention_cases(quick: bool) -> list[Case]:
    """Batched `matmul` as attention runs it: q @ k^T and p @ v on heads split out of a
    (batch, seq, hidden) activation by a view and a transpose, so torch copies the strided
    operands first (part of what such a matmul costs in eager mode)."""
    import torch

    matmul = get_op("matmul").impl
    cases: list[Case] = []
    for b, s, h, d in ATTENTION_SHAPES[:2] if quick else ATTENTION_SHAPES:
        q, k, v = (torch.randn(b, s, h, d, requires_grad=True).transpose(1, 2) for _ in range(3))
        p = torch.randn(b, h, s, s, requires_grad=True)
        flops = 2.0 * b * h * s * s * d
        kt = k.transpose(-2, -1)
        cases.append((partial(matmul, q, kt), [q, kt], flops))
        cases.append((partial(matmul, p, v), [p, v], flops))
    return cases


def matmul_fit(cases: Sequence[Case], budget: float, engine: float, speed: SpeedIndex | None = None) -> KernelFit:
    """Forward and backward of `cases` fitted in FLOPs (backward: 2x the forward's)."""
    flops, fwd, bwd, raw = [], [], [], []
    for fn, wrt, f in cases:
        tf, tb = _fwd_bwd(fn, wrt, budget, speed)
        flops.append(f)
        fwd.append(tf)
        bwd.append(max(tb - engine, 0.0))
        raw.append(tb)
    ff, fb = fit_affine(flops, fwd), fit_affine([2 * f for f in flops], bwd, raw)
    return KernelFit(ff.alpha, ff.beta, fb.alpha, fb.beta)


OPTIMIZER_CASES = ((64, 512), (16, 16384), (4, 262144))  # (tensors, elements each)


def optimizer_fit(budget: float, speed: SpeedIndex | None = None) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per element) of AdamW's step plus zero_grad, fitted
    in relative error over `OPTIMIZER_CASES` (both >= 0)."""
    import torch

    samples = []
    for count, numel in OPTIMIZER_CASES:
        params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn(numel)
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
        buffer = torch.zeros(COLD_BYTES // 4)

        def step(opt: Any = opt, buffer: Any = buffer) -> tuple[float, float]:
            evict(buffer)  # the states are out of cache after backward, as in a step
            t0 = time.thread_time()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return time.thread_time() - t0, 0.0

        samples.append((count, count * numel, timed(step, budget, speed)[0]))
    return fit_two_terms(samples)


def measure_eager(quick: bool = False, progress: Callable[[str], None] | None = None,
                  speed: SpeedIndex | None = None) -> EagerCosts:
    """Every class's fit and the optimizer's, in this process at one intra-op thread (module doc),
    each at `speed`'s reference speed when given.
    About 3 s with `quick`, about 8 s without, on an idle core."""
    import torch

    budget = 0.02 if quick else 0.15
    sizes = (4096, 65536) if quick else (4096, 32768, 131072, 524288)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        say = progress or (lambda _: None)
        say("eager ops: views")
        view, engine = view_costs(budget, speed=speed)
        kinds: list[tuple[str, KernelFit]] = [("view", view)]
        say("eager ops: matmul")
        linear = matmul_fit(linear_cases(quick), budget, engine, speed)
        attention = matmul_fit(attention_cases(quick), budget, engine, speed)
        kinds += [("matmul", linear), ("linear", linear), ("attention_matmul", attention)]
        for kind in REPRESENTATIVE:
            say(f"eager ops: {kind}")
            kinds.append((kind, kernel_fit(kind, sizes, budget, engine, speed)))
        say("gradient accumulation")
        kinds.append(("accumulate_grad", accumulate_fit(budget, speed=speed)))
        say("optimizer step")
        per_tensor, per_param = optimizer_fit(budget, speed)
    finally:
        torch.set_num_threads(threads)
    return EagerCosts(tuple(kinds), per_tensor, per_param)
