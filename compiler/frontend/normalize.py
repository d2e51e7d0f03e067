"""Lowering rules for compute: matmuls, norms, softmax, attention, embeddings, dropout, losses
and reductions. Each rule states the torch calls it covers in its `@rule`; elementwise math is
`elementwise` (imported here, so that importing this module fills both tables).

Shapes come from the call's own result (`res`).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F

from shardc.frontend.elementwise import binary
from shardc.frontend.emit import Emitter, Unsupported, dtype_name
from shardc.frontend.rules import aten, rule
from shardc.ir import Value

# ---- contractions, norms, softmax ------------------------------------------------------------

@rule(F.linear, aten("linear"))
def _linear(e: Emitter, res: Any, x: Value, weight: Value, bias: Value | None = None, **_: Any) -> Value:
    return e.emit("linear", [x, weight] + ([bias] if bias is not None else []))


@rule(torch.matmul, operator.matmul, torch.mm, torch.bmm, "matmul", "__matmul__", "mm", "bmm",
      aten("matmul"), aten("mm"), aten("bmm"))
def _matmul(e: Emitter, res: Any, a: Value, b: Value, **_: Any) -> Value:
    return e.emit("matmul", [a, b])


@rule(torch.addmm, torch.baddbmm, "addmm", "baddbmm", aten("addmm"), aten("baddbmm"))
def _addmm(e: Emitter, res: Any, bias: Any, a: Value, b: Value, *, beta: Any = 1, alpha: Any = 1, **_: Any) -> Value:
    """addmm(bias, a, b) = beta * bias + alpha * (a @ b); HF's Conv1D is this."""
    y = e.emit("matmul", [a, b])
    if alpha != 1:
        y = e.emit("mul", [y], other=alpha)
    if beta == 0:
        return y
    if beta != 1:
        bias = binary(e, "mul", bias, beta, True)
    return binary(e, "add", y, bias, True)


def _last_dim_only(x: Value, normalized_shape: Any, what: str) -> None:
    shape = tuple(normalized_shape) if isinstance(normalized_shape, list | tuple | torch.Size) else (normalized_shape,)
    if shape != x.type.shape[-1:]:
        raise Unsupported(f"{what} over {shape} of a {x.type} tensor (only the last dim is supported)")


@rule(F.layer_norm, aten("layer_norm"))
def _layer_norm(e: Emitter, res: Any, x: Value, normalized_shape: Any, weight: Value | None = None,
                bias: Value | None = None, eps: float = 1e-5, *_: Any, **__: Any) -> Value:
    _last_dim_only(x, normalized_shape, "layer_norm")
    if weight is None and bias is not None:
        raise Unsupported("layer_norm with a bias but no weight")
    inputs = [x] + [v for v in (weight, bias) if v is not None]
    return e.emit("layer_norm", inputs, eps=float(eps))


@rule(getattr(F, "rms_norm", None), aten("rms_norm"))
def _rms_norm(e: Emitter, res: Any, x: Value, normalized_shape: Any, weight: Value | None = None,
              eps: float | None = None, **_: Any) -> Value:
    _last_dim_only(x, normalized_shape, "rms_norm")
    if eps is None:
        eps = torch.finfo(e.meta(x).dtype).eps
    return e.emit("rms_norm", [x] + ([weight] if weight is not None else []), eps=float(eps))


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _softmax_rule(op: str) -> Any:
    def lower(e: Emitter, res: Any, x: Value, dim: Any = None, *rest: Any, dtype: Any = None, **_: Any) -> Value:
        if dim is None:
            raise Unsupported(f"{op} without dim")
        if dtype is not None:
            x = e.emit("cast", [x], dtype=dtype_name(dtype))
        return e.emit(op, [x], dim=_dim(dim, x.type.rank))
    return lower


rule(F.softmax, torch.softmax, "softmax", aten("softmax"))(_softmax_rule("softmax"))
rule(F.log_softmax, torch.log_softmax, "log_softmax", aten("log_softmax"))(_softmax_rule("log_softmax"))


@rule(aten("_softmax"))
def _aten_softmax(e: Emitter, res: Any, x: Value, dim: int, half_to_float: bool = False, **_: Any) -> Value:
    return e.emit("softmax", [x], dim=_dim(dim, x.type.rank))


@rule(aten("_log_softmax"))
def _aten_log_softmax(e: Emitter, res: Any, x: Value, dim: int, half_to_float: bool = False, **_: Any) -> Value:
    return e.emit("log_softmax", [x], dim=_dim(dim, x.type.rank))


@rule(F.embedding)
def _embedding(e: Emitter, res: Any, ids: Value, weight: Value, padding_idx: Any = None, max_norm: Any = None,
               **_: Any) -> Value:
    if max_norm is not None:
        raise Unsupported("embedding with max_norm (it renormalises the table in place)")
    return e.emit("embedding", [ids, weight])


@rule(aten("embedding"))
def _aten_embedding(e: Emitter, res: Any, weight: Value, ids: Value, *_: Any, **__: Any) -> Value:
    return e.emit("embedding", [ids, weight])


@rule(F.dropout, torch.dropout, aten("dropout"))
def _dropout(e: Emitter, res: Any, x: Value, p: float = 0.5, training: bool = True, *_: Any, **__: Any) -> Value:
    return e.emit("dropout", [x], p=float(p), training=bool(training))


@rule(F.scaled_dot_product_attention, aten("scaled_dot_product_attention"))
def _sdpa(e: Emitter, res: Any, q: Value, k: Value, v: Value, attn_mask: Value | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False, **_: Any) -> Value:
    if dropout_p:
        return attention_math(e, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    attrs: dict[str, Any] = {"is_causal": bool(is_causal)}
    if scale is not None:
        attrs["scale"] = float(scale)
    if enable_gqa and q.type.shape[-3] != k.type.shape[-3]:
        attrs["enable_gqa"] = True
    return e.emit("scaled_dot_product_attention", [q, k, v] + ([attn_mask] if attn_mask is not None else []), **attrs)


def attention_math(e: Emitter, q: Value, k: Value, v: Value, mask: Value | None, dropout_p: float,
                   is_causal: bool, scale: float | None, enable_gqa: bool) -> Value:
    """Attention with dropout on the probabilities, written out (the fused op has no dropout)."""
    heads, groups = q.type.shape[-3], k.type.shape[-3]
    if enable_gqa and heads != groups:  # repeat each key/value head heads/groups times
        rep = heads // groups
        k, v = (e.emit("reshape", [e.emit("expand", [e.emit("reshape", [t], shape=t.type.shape[:-2] + (1,) + t.type.shape[-2:])],
                                           shape=t.type.shape[:-2] + (rep,) + t.type.shape[-2:])],
                       shape=t.type.shape[:-3] + (heads,) + t.type.shape[-2:]) for t in (k, v))
    kt = e.emit("permute", [k], dims=tuple(range(k.type.rank - 2)) + (k.type.rank - 1, k.type.rank - 2))
    scores = e.emit("mul", [e.emit("matmul", [q, kt])], other=scale if scale is not None else 1 / math.sqrt(q.type.shape[-1]))
    s, t = q.type.shape[-2], k.type.shape[-2]
    if is_causal:
        future = e.emit("triu", [e.emit("full", [], shape=(s, t), value=True, dtype="bool")], diagonal=1)
        scores = e.emit("masked_fill", [scores, future], value=float("-inf"))
    if mask is not None:
        scores = (e.emit("masked_fill", [scores, e.emit("logical_not", [mask])], value=float("-inf"))
                  if mask.type.dtype == "bool" else e.emit("add", [scores, mask]))
    probs = e.emit("dropout", [e.emit("softmax", [scores], dim=scores.type.rank - 1)], p=float(dropout_p), training=True)
    return e.emit("matmul", [probs, v])


# ---- losses ------------------------------------------------------------------------------------

def _cross_entropy_core(e: Emitter, x: Value, target: Value, ignore_index: int, reduction: str) -> Value:
    if target.type.is_float:
        raise Unsupported("cross_entropy with class probabilities as targets (only class indices)")
    if x.type.rank > 2:  # torch puts classes in dim 1; the IR op wants them last
        rank = x.type.rank
        x = e.emit("permute", [x], dims=(0,) + tuple(range(2, rank)) + (1,))
    attrs: dict[str, Any] = {}
    if ignore_index != -100:
        attrs["ignore_index"] = int(ignore_index)
    if reduction != "mean":
        attrs["reduction"] = reduction
    return e.emit("cross_entropy", [x, target], **attrs)


@rule(F.cross_entropy)
def _cross_entropy(e: Emitter, res: Any, x: Value, target: Value, weight: Any = None, size_average: Any = None,
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0, **_: Any) -> Value:
    if weight is not None or label_smoothing or size_average is not None or reduce is not None:
        raise Unsupported("cross_entropy with class weights, label smoothing or legacy size_average/reduce")
    return _cross_entropy_core(e, x, target, ignore_index, reduction)


@rule(aten("cross_entropy_loss"))
def _aten_cross_entropy(e: Emitter, res: Any, x: Value, target: Value, weight: Any = None, reduction: int = 1,
                        ignore_index: int = -100, label_smoothing: float = 0.0, **_: Any) -> Value:
    if weight is not None or label_smoothing:
        raise Unsupported("cross_entropy with class weights or label smoothing")
    return _cross_entropy_core(e, x, target, ignore_index, ("none", "mean", "sum")[reduction])


@rule(F.mse_loss)
def _mse(e: Emitter, res: Any, x: Value, target: Value, size_average: Any = None, reduce: Any = None,
         reduction: str = "mean", **_: Any) -> Value:
    diff = e.emit("sub", [x, target])
    sq = e.emit("mul", [diff, diff])
    if reduction == "none":
        return sq
    return e.emit("mean" if reduction == "mean" else "sum", [sq])


# ---- reductions --------------------------------------------------------------------------------

def _reduction(op: str) -> Any:
    def lower(e: Emitter, res: Any, x: Value, dim: Any = None, keepdim: bool = False, *, dtype: Any = None,
              **_: Any) -> Value:
        if isinstance(dim, torch.dtype):  # aten.sum.default(x, dtype)
            dim, dtype = None, dim
        if dtype is not None:
            x = e.emit("cast", [x], dtype=dtype_name(dtype))
        if isinstance(dim, int):
            dim = (dim,)
        if dim is not None and len(dim) == 0:
            dim = None
        attrs: dict[str, Any] = {}
        if dim is not None:
            attrs["dim"] = tuple(sorted(_dim(d, x.type.rank) for d in dim))
        if keepdim:
            attrs["keepdim"] = True
        return e.emit(op, [x], **attrs)
    return lower


rule(torch.sum, "sum", aten("sum"))(_reduction("sum"))
rule(torch.mean, "mean", aten("mean"))(_reduction("mean"))
rule(torch.amax, "amax", aten("amax"))(_reduction("amax"))


@rule(torch.max, "max")
def _max(e: Emitter, res: Any, x: Value, *args: Any, **kwargs: Any) -> Value:
    if args or kwargs:
        other = args[0] if args else kwargs.get("other")
        if isinstance(other, Value):
            return e.emit("maximum", [x, other])
        raise Unsupported("max over a dim (it also returns indices); use amax")
    return e.emit("amax", [x])


@rule(torch.gather, "gather", aten("gather"))
def _gather(e: Emitter, res: Any, x: Value, dim: int, index: Value, *_: Any, **__: Any) -> Value:
    return e.emit("gather", [x, index], dim=_dim(dim, x.type.rank))


@rule(torch.cumsum, "cumsum", aten("cumsum"))
def _cumsum(e: Emitter, res: Any, x: Value, dim: int, *, dtype: Any = None, **_: Any) -> Value:
    if dtype is not None and not dtype.is_floating_point and dtype != torch.int64:
        # the registry's cumsum widens integers to i64 as torch does without a dtype; a narrower
        # integer result is the aten op's own (the fallback)
        raise Unsupported(f"cumsum accumulating in {dtype}")
    if dtype is not None:
        x = e.emit("cast", [x], dtype=dtype_name(dtype))
    return e.emit("cumsum", [x], dim=_dim(dim, x.type.rank))
