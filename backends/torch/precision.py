"""Mixed precision as the plan's `dtype` says and the cost model prices it (Megatron/torchtitan style).

Rule. With `dtype=bf16` or `fp16` (the lowered graph's `dtype` attribute, `bf16` / `f16`):
- master weights stay fp32 `nn.Parameter`s; the generated code casts every float parameter and
  buffer to the compute dtype where it is read (`weight_copy(..., torch.bfloat16)` in
  `module.code`, once per region) and every float graph input where it enters (`.to`), so each
  float op of the IR runs in the compute dtype and every activation is held in it. A weight's
  copy is made once and shared by every micro-batch that reads it until the optimizer changes
  the weight (`weight_copy`: a pipeline stage holds one copy, not one per micro-batch in flight;
  a layer recomputing in full holds it only while it runs). Autograd through the cast lands the
  weight gradients in fp32 on the fp32 parameters, so DDP reduces fp32 gradients (Megatron's
  accumulate-allreduce-grads-in-fp32) and AdamW keeps fp32 states; a weight read by nodes that
  split the batch on tp has its fp32 gradient summed over tp once per step too (`gradsum`), as
  the model prices it (a weight with per-use `grad_all_reduce` markers left, read replicated by
  some reader that does not split tp, sums its copy's gradient in the compute dtype);
- a loss op (`kind == "loss"`: cross entropy) reads its float inputs in fp32, as Megatron
  computes the loss and as `train.default_loss` does for a model without one: its
  log-probabilities and their gradient are fp32;
- under FSDP2 (ZeRO >= 1) `MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)`: the
  gathers move compute-dtype weights and the in-code cast finds them in the compute dtype
  already (`Tensor.to` returns the tensor itself: no copy);
- fp16 trains with a loss scaler (`torch.amp.GradScaler`): the runtime's `step` scales the loss
  before backward and the training loop steps through `scaled_step`, which agrees on skipped
  steps across all ranks (a non-finite gradient on one tensor-parallel shard skips the step
  everywhere). bf16 needs none.
With `dtype=fp32` (or none) nothing is cast.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from shardc.ir import Graph, Value
from shardc.ir.dtypes import ir_dtype, torch_dtype
from shardc.ops.registry import get_op

_COMPUTE = {"bf16": torch.bfloat16, "f16": torch.float16}
SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def compute_dtype(graph: Graph | None) -> torch.dtype | None:
    """The torch compute dtype a lowered graph's `dtype` attribute names, None for fp32 (no casts)."""
    if graph is None:
        return None
    name = graph.attrs.get("dtype")
    return _COMPUTE.get(ir_dtype(str(name))) if name else None


def runtime_dtype(v: Value, compute: torch.dtype | None) -> torch.dtype:
    """The torch dtype value `v` has when the generated code runs: the compute dtype for a float
    value, fp32 for a loss's output (the loss reads fp32), its own dtype for anything else."""
    own = torch_dtype(v.type.dtype)
    if compute is None or not v.type.is_float:
        return own
    producer = v.producer
    return torch.float32 if producer is not None and get_op(producer.op).kind == "loss" else compute


def cast(g: fx.Graph, node: fx.Node, dtype: torch.dtype, name: str, weight: bool = False) -> fx.Node:
    """`node.to(dtype)` in the generated code, named `<name>_<dtype>` so `.code` shows the cast;
    a parameter or buffer (`weight`) through `weight_copy`, one copy however many micro-batches read it."""
    if weight:
        return g.create_node("call_function", weight_copy, (node, dtype), {}, name=f"{name}_{SUFFIX[dtype]}")
    return g.create_node("call_method", "to", (node, dtype), {}, name=f"{name}_{SUFFIX[dtype]}")


# Each weight's live compute-dtype copy, held weakly on both sides: an entry keeps neither the
# weight nor its copy alive; every reader's view keeps the copy (its base) alive, so the copy lives
# exactly as long as autograd (or a running layer) holds a reader's view of it.
_COPIES: Any = WeakIdKeyDictionary()


class _Reader(torch.autograd.Function):
    """One reader of a weight's shared copy: forward, a view of the copy (no new storage);
    backward, the reader's gradient in the weight's dtype. One node per reader, so the gradients
    of readers in one backward (micro-batches run inside one forward) sum on the fp32 weight, as
    separate casts' would, never in the compute dtype."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def weight_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight.to(dtype)`, one copy shared by every reader while one holds it and the weight is
    unchanged (its in-place version counter: the optimizer step bumps it). A pipeline stage with k
    micro-batches in flight so holds one copy of its weights, not k: each micro-batch's matmuls
    save a view of the copy the first one made (`_Reader`), and each reader's gradient reaches the
    fp32 weight on its own. A layer that recomputes in full saves nothing, so its copy dies when
    its forward ends and is made again for its backward: held only while it runs. Without
    autograd (no_grad, a frozen weight) or under `torch.compile` (a traced cast is the compiler's
    to place) a plain cast."""
    if weight.dtype == dtype or torch.compiler.is_compiling() or not (weight.requires_grad and torch.is_grad_enabled()):
        return weight.to(dtype)  # FSDP2 gathered it in the compute dtype already: no copy
    entry = _COPIES.get(weight)
    copy = entry[1]() if entry is not None and entry[0] == weight._version else None
    if copy is None or copy.dtype != dtype:
        copy = weight.detach().to(dtype)
        _COPIES[weight] = (weight._version, weakref.ref(copy))
    return _Reader.apply(weight, copy)
    copy = weight.to(dtype)
    _COPIES[weight] = (weight._version, weakref.ref(copy))
    return copy


def mixed_precision_policy(dtype: torch.dtype | None) -> Any:
    """FSDP2's policy for a compute dtype: gather in it, reduce-scatter gradients in fp32; None for fp32."""
    if dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def grad_scaler(dtype: torch.dtype | None, device: torch.device | str = "cpu",
                init_scale: float = 2.0**16) -> torch.amp.GradScaler | None:
    """A loss scaler for fp16 (torch's defaults: 2**16, halved on overflow, doubled every 2000 steps); None otherwise."""
    if dtype is not torch.float16:
        return None
    device = torch.device(device)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)
    # Make its scale now: a pipeline rank without the loss never scales one, yet steps with the others.
    scaler.scale(torch.ones((), device=device))
    return scaler


def scaler_of(module: Any) -> torch.amp.GradScaler | None:
    """The loss scaler a parallelized module trains with (`grad_scaler` attribute, or its wrapped module's)."""
    found = getattr(module, "__dict__", {}).get("grad_scaler")
    if found is None and hasattr(module, "module"):
        found = getattr(module.module, "__dict__", {}).get("grad_scaler")
    return found


def attach_scaler(scaler: torch.amp.GradScaler | None, *modules: Any) -> None:
    """Make `scaler` the loss scaler of `modules` (a plain attribute, not module state)."""
    for m in modules:
        object.__setattr__(m, "grad_scaler", scaler)


def scaled_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> bool:
    """`optimizer.step()`, through `scaler` when there is one: unscale the gradients, agree on
    overflow over the whole world (max of every rank's found-inf), step unless any rank found a
    non-finite gradient, update the scale. Returns whether the step was taken."""
    if scaler is None:
        optimizer.step()
        return True
    import torch.distributed as dist

    scaler.unscale_(optimizer)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in found.values():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    skipped = any(float(t.item()) > 0 for t in found.values())
    scaler.step(optimizer)
    scaler.update()
    return not skipped
