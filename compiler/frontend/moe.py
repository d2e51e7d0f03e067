"""transformers' routed-expert modules captured as one `experts` op (`shardc.ops.moe`).

Rule. A module is an expert block when it holds 3-D `gate_up_proj` (experts, 2 x intermediate,
hidden) and `down_proj` (experts, hidden, intermediate) parameters in transformers' default
layout (concatenated gate then up, not transposed, no bias, gated: the `use_experts_implementation`
flags) and an activation the op knows (`config.hidden_act`), and its forward takes
`(hidden_states, top_k_index, top_k_weights)`: Mixtral, Qwen3-MoE and DeepSeek-V3 in the
installed transformers. While a model is captured (`one_op_experts`), each such module's
forward is the custom op `torch.ops.shardc.experts` (a leaf for torch.fx and torch.export
alike, with a fake kernel for shapes), not its data-dependent loop over experts; the rule below
lowers it to the registry op `experts`. Other expert layouts trace through as before.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from shardc.frontend.emit import Emitter
from shardc.frontend.rules import ATEN, FUNCTIONS, rule
from shardc.ops.moe import ACTIVATIONS, local_experts

_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")


@torch.library.custom_op("shardc::experts", mutates_args=())
def experts_op(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, act: str) -> torch.Tensor:
    """transformers' expert block as one call (only while capturing: it has no autograd)."""
    return local_experts(x, index, weights, gate_up, down, act)


@experts_op.register_fake
def _experts_fake(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, act: str) -> torch.Tensor:
    return torch.empty_like(x)


def expert_activation(module: torch.nn.Module) -> str | None:
    """The activation name when `module` is an expert block the `experts` op computes, else None."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)):
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] \
            or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return None
    flags = (getattr(module, "has_gate", True), getattr(module, "has_bias", False),
             getattr(module, "is_transposed", False), getattr(module, "is_concatenated", True),
             getattr(module, "has_post_expert_norm", False))
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    if flags != (True, False, False, True, False) or act not in ACTIVATIONS:
        return None
    try:
        names = tuple(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return None
    return str(act) if names[1:4] == _ARGUMENTS else None


@contextlib.contextmanager
def one_op_experts(model: torch.nn.Module) -> Iterator[int]:
    """Within: every expert block of `model` runs as `torch.ops.shardc.experts` (yields how many)."""
    patched = []
    for module in model.modules():
        act = expert_activation(module)
        if act is None or "forward" in vars(module):
            continue
        signature = inspect.signature(type(module).forward)

        def forward(*args: Any, _m: torch.nn.Module = module, _act: str = act,
                    _sig: inspect.Signature = signature, **kwargs: Any) -> Any:
            bound = _sig.bind(_m, *args, **kwargs).arguments
            return torch.ops.shardc.experts(*(bound[name] for name in _ARGUMENTS), _m.gate_up_proj,
                                            _m.down_proj, _act)
        module.forward = forward  # type: ignore[method-assign]
        patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward


@rule(torch.ops.shardc.experts)
def _experts(e: Emitter, res: Any, x: Any, index: Any, weights: Any, gate_up: Any, down: Any, act: str) -> Any:
    return e.emit("experts", [x, index, weights, gate_up, down], act=act)


FUNCTIONS[torch.ops.shardc.experts] = ATEN[torch.ops.shardc.experts]  # fx records the packet itself
