"""The collectives a rank runs, as the memory tracker records them from the ops it dispatches.

Rule: a c10d op's name gives its kind (`collective_kind`: `c10d.allreduce_.default` ->
`all_reduce`; waits, barriers and unknown ops are none); its group size comes from the process
group among its arguments (an object with `size()`, or a group name), else the world's.
"""

from __future__ import annotations

import torch


def _group_size(args: tuple) -> int:
    import torch.distributed as dist

    for a in args:
        size = getattr(a, "size", None)
        if callable(size) and not isinstance(a, torch.Tensor):
            try:
                return int(size())
            except Exception:  # a ScriptObject without size()
                continue
        if isinstance(a, str):
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group

                return dist.get_world_size(_resolve_process_group(a))  # type: ignore[arg-type]
            except Exception:
                continue
    return dist.get_world_size() if dist.is_initialized() else 1


_KINDS = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "allgather": "all_gather",
          "_allgather_base": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
          "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
          "reduce_scatter_tensor_coalesced": "reduce_scatter", "broadcast": "broadcast", "alltoall": "all_to_all",
          "alltoall_base": "all_to_all", "send": "send", "recv": "recv", "all_reduce": "all_reduce",
          "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def collective_kind(op_name: str) -> str | None:
    """`c10d.allreduce_.default` -> `all_reduce`; None for waits, barriers and unknown ops."""
    parts = op_name.split(".")
    base = parts[1] if len(parts) > 1 else parts[0]
    return _KINDS.get(base.rstrip("_"))
