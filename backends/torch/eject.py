"""Eject: a plan as idiomatic torch code that needs no shardc, and torch's own Megatron TP plan.

Rule: the parts of a plan that torch.distributed names are written in torch's words:
tensor parallelism as `parallelize_module` with `ColwiseParallel`/`RowwiseParallel` on each
block's linears (Megatron's pairing: the first linear of attention and of the MLP column-wise,
the one that closes it row-wise), sequence parallelism as `SequenceParallel` on the norms,
data parallelism as `DistributedDataParallel` (zero=0 without tp) or `fully_shard` (zero>=1, or with
tp: DDP takes no DTensor parameters, FSDP2 over dp is torch's 2-D recipe), pipelines as
`PipelineStage` plus a schedule class. What torch has no word for is listed in `unsupported`
and left out of the code: temporal or rotating partitions, context parallelism (ring attention),
per-node partitions that differ from Megatron's pairing, and selective recomputation
of an attention written out as matmuls. Full recomputation is emitted as the backend runs it:
the blocks that recompute (apply-plan's rule: transformer blocks only, the first
`recompute_layers` of each model chunk) call their forward through
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`.

The same discovery (`megatron_plan`) gives `apply_tensor_parallel`, the hand-written baseline of
`benchmarks/runtime.py`.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardc.ir.diagnostics import ShardcError

# Megatron's pairing by the names models give their linears (GPT, Llama, GPT-NeoX, BERT style).
COLWISE = frozenset({"q", "k", "v", "query", "key", "value", "q_proj", "k_proj", "v_proj",
                     "wq", "wk", "wv", "fc1", "c_fc", "fc_in", "up", "up_proj", "gate", "gate_proj", "w1", "w3"})
ROWWISE = frozenset({"proj", "o", "o_proj", "out_proj", "c_proj", "wo", "fc2", "fc_out", "down", "down_proj", "w2"})
# A fused q/k/v projection is Megatron-sharded per q, k and v block (interleaved), which torch's
# ColwiseParallel (one contiguous shard) cannot say.
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "n_kv_head", "n_kv_heads", "num_key_value_heads")
FUSED_QKV = frozenset({"qkv", "c_attn", "query_key_value", "Wqkv"})


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: its largest `nn.ModuleList` (ties: the first one found)."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    if best is None or len(best[1]) == 0:
        raise ShardcError(f"model {type(model).__name__} has no nn.ModuleList of blocks",
                          hint="tensor parallelism by name shards the linears of the model's repeated blocks")
    return best


def megatron_plan(model: nn.Module) -> dict[str, str]:
    """Module path -> "colwise" | "rowwise" for every `nn.Linear` in the model's blocks, by name.

    Only linears under the model's block list are planned (embedding and head stay replicated);
    a block with column-wise linears but no row-wise one (or the reverse) is an error, since the
    pairing would leave a partial sum or a shard unclosed.
    """
    prefix, blocks = block_list(model)
    out: dict[str, str] = {}
    for i, block in enumerate(blocks):
        base = f"{prefix}.{i}" if prefix else str(i)
        found: dict[str, str] = {}
        for name, mod in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(mod, nn.Linear) and leaf in FUSED_QKV:
                raise ShardcError(f"{base}.{name} is a fused q/k/v projection: Megatron shards it per q, k and v "
                                  "block, which torch's ColwiseParallel cannot express",
                                  hint="use shardc's own code generation (plan.parallelize) for this model, "
                                  "or a model with separate q, k and v linears")
            if isinstance(mod, nn.Linear) and leaf in COLWISE:
                found[f"{base}.{name}"] = "colwise"
            elif isinstance(mod, nn.Linear) and leaf in ROWWISE:
                found[f"{base}.{name}"] = "rowwise"
        kinds = set(found.values())
        if kinds and kinds != {"colwise", "rowwise"}:
            raise ShardcError(f"block {base}: found only {kinds.pop()} linears ({', '.join(found)}); Megatron's "
                              "tensor parallelism needs a column-wise linear closed by a row-wise one")
        out.update(found)
    if not out:
        raise ShardcError(f"no linears with Megatron names ({', '.join(sorted(COLWISE | ROWWISE))}) under the "
                          f"block list of {type(model).__name__}", hint="tensor parallelism by name needs them")
    return out


def apply_tensor_parallel(module: nn.Module, tp_mesh: Any, plan: dict[str, str] | None = None) -> nn.Module:
    """Shard `module` over `tp_mesh` with torch's `parallelize_module` and the Megatron plan.

    Paths in `plan` not present in `module` are skipped (a pipeline stage holds some blocks).
    The attention code must size its head reshape from the tensor (`view(b, s, -1, d)`), or the
    local head count must be set by the caller.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = plan if plan is not None else megatron_plan(module)
    present = {name for name, _ in module.named_modules()}
    styles: dict[str, Any] = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel()
                              for k, v in plan.items() if k in present}
    parallelize_module(module, tp_mesh, styles)
    _shrink_head_counts(module, tp_mesh.size())
    return module


def _shrink_head_counts(module: nn.Module, tp: int) -> None:
    """Attention modules that keep `n_head`/`n_embd` as attributes see the local share after TP."""
    for mod in module.modules():
        for attr in (*HEAD_ATTRS, "n_embd", "hidden_size"):
            value = getattr(mod, attr, None)
            if isinstance(value, int) and not isinstance(mod, nn.Linear) and any(
                    isinstance(c, nn.Linear) for c in mod.children()):
                if value % tp:
                    raise ShardcError(f"{type(mod).__name__}.{attr}={value} is not divisible by tp={tp}")
                setattr(mod, attr, value // tp)


# ---- eject --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Ejected:
    """The emitted code and the parts of the plan it could not express."""

    code: str
    unsupported: tuple[str, ...]

    def __str__(self) -> str:
        return self.code


def unsupported_parts(plan: Any, graph: Any = None) -> list[str]:
    """What in `plan` (a ParallelPlan) and in the partitioned `graph` torch's vocabulary cannot say."""
    out: list[str] = []
    if getattr(plan, "cp", 1) > 1:
        out.append(f"context parallelism cp={plan.cp} (ring attention): torch's context_parallel is experimental; "
                   "not emitted")
    if getattr(plan, "recompute", "none") == "selective" and _has_core(graph):
        out.append("selective recomputation: shardc checkpoints each attention core (QK^T through PV, "
                   "shardc.analysis.attention) as a module of its own, a region the model's source does not "
                   "delimit (torch's selective activation checkpointing chooses by op, not by region); "
                   "emitted code recomputes nothing, so it keeps the cores' scores and probabilities")
    if graph is not None:
        for node in graph.nodes:
            if node.partition is not None and node.partition.temporal:
                out.append(f"temporal partition {node.partition} on {node.op} @{node.location.module_path}: "
                           "a loop of rotating shards torch has no placement for")
    return out


def _has_core(graph: Any) -> bool:
    """Whether selective recomputation drops anything in `graph` (unknown without a graph: yes).
    A model with fused attention (sdpa) has no core: shardc recomputes nothing there either."""
    if graph is None:
        return True
    from shardc.analysis.attention import attention_core, batch_dependent, layer_nodes

    batched = batch_dependent(graph)
    return any(attention_core(nodes, batched) for nodes in layer_nodes(graph).values())


def recomputed_blocks(plan: Any, blocks: int) -> tuple[int, ...]:
    """Indices of the blocks recomputed under `recompute=full` (apply-plan's rule: the first
    `recompute_layers` blocks of each of the pp*vpp model chunks; all when not set)."""
    if plan.recompute != "full":
        return ()
    from shardc.analysis.stages import stage_sizes

    out: list[int] = []
    start = 0
    for size in stage_sizes(blocks, max(1, min(plan.stages, blocks))):
        keep = size if plan.recompute_layers is None else min(size, plan.recompute_layers)
        out += range(start, start + keep)
        start += size
    return tuple(out)


def eject(plan: Any, model_spec: str, graph: Any = None) -> str:
    """Python source for `plan` on the model `model_spec` using torch.distributed only.

    The file builds the model from the spec's factory, applies tensor/sequence parallelism,
    pipeline stages and data parallelism, and trains a few steps; run it with
    `torchrun --nproc-per-node N file.py`. Parts of the plan torch cannot express are listed
    in a comment at the top (see `unsupported_parts`).
    """
    return eject_plan(plan, model_spec, graph).code


def eject_plan(plan: Any, model_spec: str, graph: Any = None) -> Ejected:
    """Like `eject`, also returning the unsupported parts as data."""
    from shardc.plan.parallel import ParallelPlan

    plan = ParallelPlan.of(plan)
    path, _, rest = model_spec.partition(":")
    factory, _, query = rest.partition("?")
    if not path.endswith(".py"):
        raise ShardcError(f"eject needs a model file spec (path/file.py:factory), not {model_spec!r}")
    kwargs = {}
    if query:
        from shardc.frontend.spec import parse_query

        kwargs = parse_query(query, model_spec)
    missing = unsupported_parts(plan, graph)
    recompute = _recompute(plan, model_spec) if plan.recompute == "full" else ()
    tp_block = _tensor_parallel(plan, model_spec, missing)
    pp_note = _pipeline_note(plan, missing)
    code = _SOURCE.format(
        plan=plan, model_spec=model_spec, nproc=plan.dp * plan.tp, header="\n".join(f"  - {m}" for m in missing)
        or "  (none)", pp_note=pp_note, head_attrs=HEAD_ATTRS, path=path, factory=factory or "default",
        kwargs=kwargs, recompute=recompute, tp_block=textwrap.indent(textwrap.dedent(tp_block), "    "),
        dp_block=textwrap.indent(textwrap.dedent(_data_parallel(plan)), "    "))
    return Ejected(code, tuple(missing))


def _tensor_parallel(plan: Any, model_spec: str, missing: list[str]) -> str:
    """`parallelize_module` with Megatron's pairing (empty without tp; what cannot be found by
    name is added to `missing`)."""
    if plan.tp <= 1:
        return ""
    try:
        from shardc.frontend.spec import load_model

        styles = megatron_plan(load_model(model_spec, device="meta").model)
    except ShardcError as err:
        missing.append(f"tensor parallelism tp={plan.tp}: {err.message} (not emitted)")
        return ""
    if not styles:
        return ""
    lines = ["", "# Tensor parallelism: Megatron's column/row pairing in every block.",
             'parallelize_module(model, mesh["tp"], {']
    lines += [f"    {k!r}: {'ColwiseParallel' if v == 'colwise' else 'RowwiseParallel'}()," for k, v in styles.items()]
    lines += ["})",
              "for mod in model.modules():  # attention modules reshape by their local head count",
              "    if any(isinstance(c, torch.nn.Linear) for c in mod.children()):",
              "        for attr in HEAD_ATTRS:",
              "            if isinstance(getattr(mod, attr, None), int):",
              '                setattr(mod, attr, getattr(mod, attr) // mesh["tp"].size())', ""]
    return "\n".join(lines)


def _recompute(plan: Any, model_spec: str) -> tuple[int, ...]:
    """The blocks (indices into `block_list`) full recomputation checkpoints."""
    from shardc.frontend.spec import load_model

    _, blocks = block_list(load_model(model_spec, device="meta").model)
    return recomputed_blocks(plan, len(blocks))


def _data_parallel(plan: Any) -> str:
    """DDP, or FSDP2 over dp when ZeRO shards or tp makes DTensor parameters (DDP takes none:
    FSDP2 over dp is torch's 2-D recipe)."""
    if plan.zero >= 1 or plan.tp > 1:
        return f"""
            if mesh["dp"].size() > 1:
                fully_shard(model, mesh=mesh["dp"], reshard_after_forward={plan.zero >= 3})
        """
    return """
            model = DistributedDataParallel(model, process_group=mesh["dp"].get_group()) if mesh["dp"].size() > 1 else model
        """


def _pipeline_note(plan: Any, missing: list[str]) -> str:
    """A comment naming torch's pipeline classes for the plan's schedule (the file trains pp=1;
    the stages are added to `missing`)."""
    if plan.pp <= 1:
        return ""
    zero_bubble = {"zbv": "ZBVZeroBubble", "interleaved-zb": "InterleavedZeroBubble", "dualpipev": "DualPipeV"}
    schedule = zero_bubble.get(plan.schedule) or (
        "Interleaved1F1B" if plan.vpp > 1 else ("GPipe" if plan.schedule == "gpipe" else "1F1B"))
    missing.append(f"pipeline pp={plan.pp}: stage modules must be cut by hand (PipelineStage needs one module per stage)")
    return (f"# Pipeline: cut the blocks into {plan.pp * plan.vpp} stages and run them with "
            f"torch.distributed.pipelining.PipelineStage and Schedule{schedule};\n"
            "# (torch.distributed.pipelining.pipeline can cut a traced model). This file trains pp=1 only.\n")


# The ejected file (`str.format` fields; doubled braces are the file's own).
_SOURCE = '''"""Ejected by shardc from plan {plan} for {model_spec}. Needs only torch.

Run: torchrun --nproc-per-node {nproc} this_file.py
Not expressed in torch's vocabulary (left out):
{header}
"""
{pp_note}import functools
import importlib.util
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

HEAD_ATTRS = {head_attrs!r}
MODEL_FILE = {path!r}
FACTORY = {factory!r}
FACTORY_KWARGS = {kwargs!r}
DP, TP = {plan.dp}, {plan.tp}
RECOMPUTE_BLOCKS = {recompute!r}  # blocks whose forward runs again in backward (recompute=full)


def build_model(seed: int = 0):
    spec = importlib.util.spec_from_file_location("ejected_model", MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the model file look their module up
    spec.loader.exec_module(module)
    torch.manual_seed(seed)
    return getattr(module, FACTORY)(**FACTORY_KWARGS)


def recompute_blocks(model):
    """Full recomputation: each block in RECOMPUTE_BLOCKS of the model's largest ModuleList keeps
    only its inputs and runs its forward again in backward (module names stay as they are)."""
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=[])
    for i in RECOMPUTE_BLOCKS:
        blocks[i].forward = functools.partial(torch.utils.checkpoint.checkpoint, blocks[i].forward,
                                              use_reentrant=False)


def parallelize(model):
    """Apply the plan to a model on every rank (the process group must be initialised)."""
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
{tp_block}    recompute_blocks(model)
{dp_block}    return model, mesh


def main(steps: int = 3) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    model, example = build_model()
    model, mesh = parallelize(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank = mesh["dp"].get_local_rank()
    idx, targets = example[0], example[1]
    share = idx.shape[0] // DP
    for step in range(steps):
        local = slice(dp_rank * share, (dp_rank + 1) * share)
        logits = model(idx[local])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets[local].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {{step}} loss {{loss.item():.6f}}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(os.environ.get("STEPS", "3")))
'''
