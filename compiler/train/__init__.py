"""One training loop, shared by `shardc run` and `shardc study`: a compiled plan trained on this rank.

Rule. `train(compiled, spec, options)` builds the model a spec names on the CPU with the
options' seed, makes this rank's module from it (`CompiledPlan.parallelize`, pipelines
included; a model that returns no loss trains on `default_loss`), then runs:
- `warmup` untimed steps (more while `Hooks.warm_again` asks: torch.compile still compiling),
  then `steps` timed steps, each started together after a barrier and
  closed by a device synchronisation (wall time, this thread's CPU time, and CUDA events on a
  GPU); step k trains on `synthetic_batch(..., seed, k)`;
- the caller's `Hooks.after_steps` (the study profiles one more step there);
- one more step under the memory tracker (`shardc.train.memory`): the peak and its breakdown by
  role, with the optimizer's state and the gradients in place as in every later step (unless
  `TrainOptions.memory` is off: the study's later rounds of a plan, whose memory it has).
A training step is forward and backward over the plan's micro-batches, AdamW `step()`
(`foreach=False`; under fp16 through the module's loss scaler, `precision.scaled_step`), then `zero_grad(set_to_none=False)`: gradients stay allocated between steps,
as Megatron's gradient buffers do, so the peak holds them. The losses reported are each step's
global mean (one all_reduce after the last step, averaged over the ranks: tensor and pipeline
ranks agree, data ranks hold their share). The full model is dropped once this rank's module is
built: a rank's memory is its own shard.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardc.backends.torch.precision import scaled_step, scaler_of
from shardc.train.memory import ddp_bucket_bytes, pipeline_buffers, storages_of, track_memory

if TYPE_CHECKING:
    from shardc.api import CompiledPlan


@dataclass(frozen=True, slots=True)
class TrainOptions:
    """How long and how to train: `warmup` untimed then `steps` timed steps, AdamW at `lr`, `seed`
    for the model's initial weights and the synthetic data; `memory`: end with the memory-tracked
    step (off, the report's memory is empty)."""

    steps: int
    warmup: int = 0
    lr: float = 1e-3
    seed: int = 0
    memory: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"train at least one timed step after >= 0 warm-up steps, not {self}")


@dataclass(frozen=True, slots=True)
class Trainee:
    """This rank's module (it holds the parameters the optimizer trains) and
    `step(batch) -> loss`: forward and backward over one global batch, the loss detached."""

    module: torch.nn.Module
    step: Callable[[Sequence[Any]], torch.Tensor]


Build = Callable[["CompiledPlan", torch.nn.Module, torch.device], Trainee]
MAX_EXTRA_WARMUP = 6  # untimed steps `Hooks.warm_again` may add (torch.compile's recompiles)


@dataclass(frozen=True, slots=True)
class RankReport:
    """What one rank measured: losses of the warm-up and timed steps (global means), the timed
    steps' wall, CPU-thread and (CUDA) GPU seconds, the tracked step's memory
    (`MemoryTracker.result`) and the collectives it ran."""

    rank: int
    backend: str
    device: str
    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]
    cpu_step_times_s: tuple[float, ...]
    gpu_step_times_s: tuple[float, ...]
    memory: dict[str, Any]
    collectives: tuple[dict[str, Any], ...]

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def peak_memory_bytes(self) -> int:
        return int(self.memory["peak_bytes"])


class Hooks:
    """What a caller adds to the loop; each method does nothing here."""

    def before_step(self, index: int, timed: bool) -> None:
        """Called before step `index` (warm-up steps first), its batch already made."""

    def warm_again(self, index: int) -> bool:
        """Called after warm-up step `index`, the `warmup` steps done: True runs one more untimed
        step (at most `MAX_EXTRA_WARMUP`; the study asks while torch.compile compiled in the last)."""
        return False

    def after_steps(self, run_step: Callable[[], None]) -> None:
        """Called after the timed steps, before the memory-tracked step; `run_step()` trains one more step."""


# ---- the model, its loss and its data ---------------------------------------------------------

def default_loss(graph: Any) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """For a model that returns no loss (an ONNX file ending at its logits): (loss_fn(outputs,
    target), target_of(batch)). Logits over token-id inputs train on next-token cross entropy
    (the target is the ids shifted by one); any other output on its mean square. None when the
    model's output already is a scalar loss."""
    import torch.nn.functional as F

    out, first = graph.outputs[0].type, graph.inputs[0].type
    if out.rank == 0:
        return None
    if out.is_float and out.rank >= 2 and not first.is_float and tuple(first.shape) == tuple(out.shape[:-1]):
        def next_token(output: Any, target: Any) -> Any:
            logits = output[0] if isinstance(output, tuple) else output
            return F.cross_entropy(_at_least_fp32(logits.reshape(-1, logits.shape[-1])), target.reshape(-1))

        return next_token, lambda batch: batch[0].roll(-1, dims=-1)

    def mean_square(output: Any, target: Any) -> Any:
        return _at_least_fp32(output[0] if isinstance(output, tuple) else output).square().mean()

    return mean_square, lambda batch: torch.zeros(batch[0].shape[0])


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` in fp32 for the loss when lower (bf16, fp16), as it is when fp32 or fp64 (an fp64 reference run)."""
    return t if t.dtype == torch.float64 else t.float()


def parallelized(compiled: CompiledPlan, model: torch.nn.Module, device: torch.device) -> Trainee:
    """The plan's own runtime: `compiled.parallelize(model)` and `module.step` (the pipeline
    schedule when pp > 1, gradient accumulation over micro-batches when pp = 1), on
    `default_loss` when the model returns none. The runtime places itself (`cuda:LOCAL_RANK`
    under NCCL), so `device` is not used."""
    default = default_loss(compiled.graph)
    # Any: `step` is the runtime's own method, which nn.Module's typing cannot see.
    module: Any
    if default is None:
        module = compiled.parallelize(model)
        return Trainee(module, lambda batch: module.step(*batch))
    loss_fn, make_target = default
    module = compiled.parallelize(model, loss_fn=loss_fn)
    return Trainee(module, lambda batch: module.step(*batch, target=make_target(batch)))


def synthetic_batch(example_inputs: Sequence[Any], vocab: int | Sequence[int], seed: int, step: int) -> list[Any]:
    """Step `step`'s batch: integer inputs uniform in [0, range), float inputs normal; fixed by
    seed and step. `vocab` is one range for every integer input, or one per input
    (`input_ranges`: a token-type id must stay below its embedding's rows)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ranges = [vocab] * len(example_inputs) if isinstance(vocab, int) else list(vocab)
    out: list[Any] = []
    for x, high in zip(example_inputs, ranges, strict=True):
        if isinstance(x, torch.Tensor) and not x.is_floating_point():
            out.append(torch.randint(0, high, tuple(x.shape), generator=g, dtype=x.dtype))
        elif isinstance(x, torch.Tensor):
            out.append(torch.randn(tuple(x.shape), generator=g, dtype=x.dtype))
        else:
            out.append(x)
    return out


def vocab_of(model: torch.nn.Module) -> int:
    """The token-id range of a model's inputs: its first embedding's size (2 without one)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            return int(m.num_embeddings)
    return 2


def input_ranges(graph: Any, input_names: Sequence[str], vocab: int) -> tuple[int, ...]:
    """Per input (by name, in `input_names` order): the rows of the embedding table it indexes in
    the traced `graph`, found from each `embedding` node's index operand back through the ops
    with one integer operand (views, reshapes, collectives) to a graph input; the smallest when
    it indexes several (BERT's token types: 2, its positions: max_positions); `vocab` for inputs
    that index none (token ids of a model whose embedding is not traced as one, targets, masks)."""
    rows: dict[str, int] = {}
    inputs = {id(v): v.name for v in graph.inputs}
    for node in graph.nodes:
        if node.op != "embedding" or len(node.inputs) < 2:
            continue
        index, table = node.inputs[0], node.inputs[1]
        while id(index) not in inputs and index.producer is not None:
            integer = [v for v in index.producer.inputs if not v.type.is_float and v.kind != "param"]
            if len(integer) != 1:
                break  # computed from several integers (an arange plus an offset): not an input's range
            index = integer[0]
        if id(index) in inputs:
            name = inputs[id(index)]
            rows[name] = min(rows.get(name, table.type.shape[0]), int(table.type.shape[0]))
    return tuple(rows.get(name, vocab) for name in input_names)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the loop ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Session:
    """What the loop trains with: the module and its step, the optimizer, and how to make step k's batch."""

    trainee: Trainee
    optimizer: torch.optim.Optimizer
    example: tuple[Any, ...]  # the inputs' shapes and dtypes, on the meta device: they hold no memory
    vocab: tuple[int, ...]  # each input's range (`input_ranges`)
    seed: int
    device: torch.device

    def batch(self, index: int) -> list[Any]:
        return [x.to(self.device) if isinstance(x, torch.Tensor) else x
                for x in synthetic_batch(self.example, self.vocab, self.seed, index)]

    def step(self, batch: Sequence[Any], tracker: Any = None) -> torch.Tensor:
        loss = self.trainee.step(batch)
        if tracker is not None:
            tracker.phase = "optimizer"
        scaled_step(self.optimizer, scaler_of(self.trainee.module))
        self.optimizer.zero_grad(set_to_none=False)
        return loss.detach().reshape(()).to(torch.float32, copy=True)


def _session(compiled: CompiledPlan, spec: str, options: TrainOptions, device: torch.device, build: Build
             ) -> _Session:
    """This rank's module, optimizer and data; the full model and its example inputs are not kept."""
    from shardc.frontend.spec import load_model

    torch.manual_seed(options.seed)
    loaded = load_model(spec, device="cpu")
    trainee = build(compiled, loaded.model, device)
    params = [p for p in trainee.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.lr, foreach=False)
    example = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in loaded.example_inputs)
    ranges = input_ranges(compiled.graph, loaded.input_names, vocab_of(loaded.model))
    return _Session(trainee, optimizer, example, ranges, options.seed, device)


def train(compiled: CompiledPlan, spec: str, options: TrainOptions, *, device: torch.device | None = None,
          build: Build = parallelized, hooks: Hooks | None = None,
          before: dict[int, Any] | None = None) -> RankReport:
    """Train the model `spec` names under `compiled` on this rank of the current process group
    (see the module doc); `build` makes this rank's module (default: the plan's runtime).
    `before` (`memory.storages_now()` taken before this run): storages the process held then
    are not this run's memory (a process that ran other plans first)."""
    device = device or torch.device("cpu")
    hooks = hooks or Hooks()
    session = _session(compiled, spec, options, device, build)
    # The compiled plan's folded constants (`const.N`, at the traced and the micro-batch's batch)
    # are its host-side copy, from which each rank's module took its own buffers (counted as
    # `model_buffers`); on a GPU they stay in host memory, so they are not this rank's.
    before = {**(before or {}), **storages_of([*compiled.constants.values(), *compiled.micro_constants.values()])}
    losses: list[torch.Tensor] = []
    warmup = 0
    while warmup < options.warmup or (warmup > 0 and warmup < options.warmup + MAX_EXTRA_WARMUP
                                      and hooks.warm_again(warmup - 1)):
        batch = session.batch(warmup)
        hooks.before_step(warmup, timed=False)
        losses.append(session.step(batch))
        warmup += 1
    times: dict[str, list[float]] = {"wall": [], "cpu": [], "gpu": []}
    for index in range(warmup, warmup + options.steps):
        batch = session.batch(index)
        hooks.before_step(index, timed=True)
        losses.append(_timed_step(session, batch, times))
    index = warmup + options.steps

    def one_more_step() -> None:
        session.step(session.batch(index))
        synchronize(device)

    hooks.after_steps(one_more_step)
    memory, collectives = _tracked_step(session, session.batch(index + 1), before) if options.memory else ({}, [])
    return RankReport(rank=dist.get_rank(), backend=str(dist.get_backend()), device=str(device),
                      losses=_global_means(losses, device), step_times_s=tuple(times["wall"]),
                      cpu_step_times_s=tuple(times["cpu"]), gpu_step_times_s=tuple(times["gpu"]),
                      memory=memory, collectives=tuple(collectives))


def _timed_step(session: _Session, batch: Sequence[Any], times: dict[str, list[float]]) -> torch.Tensor:
    """One step started with the other ranks and timed to its end on this rank."""
    device = session.device
    dist.barrier()
    synchronize(device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else []
    c0 = time.thread_time()  # this rank's main-thread CPU time: the step's work without the load
    t0 = time.perf_counter()
    if events:
        events[0].record()
    loss = session.step(batch)
    if events:
        events[1].record()
    synchronize(device)
    times["wall"].append(time.perf_counter() - t0)
    times["cpu"].append(time.thread_time() - c0)
    if events:
        times["gpu"].append(events[0].elapsed_time(events[1]) / 1e3)
    return loss


def _tracked_step(session: _Session, batch: Sequence[Any], before: dict[int, Any] | None = None
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One step under the memory tracker: (its `result()`, the collectives it ran)."""
    module = session.trainee.module
    # DDP's gradient buckets live in C++: their size comes from DDP's log (a pipeline: DDP per stage).
    wrappers = [stage.submod for stage in getattr(module, "stages", [])] or [module]
    extra = {"buffers": float(sum(ddp_bucket_bytes(m) for m in wrappers))}
    stages = getattr(module, "stages", None)
    held = pipeline_buffers(stages) if stages else None
    detail = bool(os.environ.get("SHARDC_MEMORY_DETAIL"))  # list the storages live at the peak (diagnosis)
    with track_memory([module], session.optimizer, extra, session.device, held, before, detail) as tracker:
        session.step(batch, tracker)
    return tracker.result(), tracker.collectives


def _global_means(losses: list[torch.Tensor], device: torch.device) -> tuple[float, ...]:
    """Each step's loss summed over the ranks and divided by their number, in one all_reduce."""
    if not losses:
        return ()
    values = torch.stack(losses).to(device=device, dtype=torch.float32)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return tuple(float(v) for v in values.cpu())
