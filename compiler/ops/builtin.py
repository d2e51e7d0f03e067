"""The built-in compute ops. Each `register(OpDef(...))` is the whole story of one op kind.

Scalars are attributes, never inputs: `mul(%x)[other=0.125]` multiplies by a constant and
`sub(%x)[other=1.0, reverse=true]` is `1 - x`. Optional tensor inputs (a bias) are simply
absent. Shapes are static; the frontend folds shape arithmetic into attributes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardc.ir import TensorType
from shardc.ir.dtypes import torch_dtype
from shardc.ops.registry import IterationSpace, OpDef, register, space_from_signature
from shardc.ops.targets import decode_operands, resolve_target

Types = Sequence[TensorType]


def dim_names(n: int, prefix: str = "d") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def aligned_space(ins: Types, outs: Types, fixed: Sequence[int] = ()) -> IterationSpace:
    """Every operand aligned from the right with the first output (broadcasting allowed);
    output dims in `fixed` cannot be split."""
    rank = outs[0].rank
    names = dim_names(rank)
    sizes = tuple(zip(names, outs[0].shape))

    def bind(t: TensorType) -> tuple[tuple[str, ...], ...]:
        off = rank - t.rank
        return tuple(() if (t.shape[i] == 1 and outs[0].shape[off + i] != 1) else (names[off + i],) for i in range(t.rank))

    unsplittable = frozenset(names[norm_dim(d, rank)] for d in fixed)
    return IterationSpace(sizes, tuple(bind(t) for t in ins), tuple(bind(t) for t in outs), unsplittable)


def elementwise(name: str, impl: Any, flops_per_element: int = 1, saves: str = "none", doc: str = "") -> OpDef:
    """An op applied element by element with broadcasting: every dim splits freely."""
    save_fn = None
    if saves == "inputs":
        def save_fn(i: Types, o: Types, a: dict[str, Any]) -> list[tuple[str, int]]:
            return [("in", k) for k, t in enumerate(i) if t.is_float]
    elif saves == "output":
        def save_fn(i: Types, o: Types, a: dict[str, Any]) -> list[tuple[str, int]]:
            return [("out", 0)]
    return register(OpDef(
        name, "elementwise", lambda i, o, a: aligned_space(i, o), impl,
        flops=lambda i, o, a: flops_per_element * o[0].numel, saves=save_fn, doc=doc,
    ))


def _binary(fn: Any) -> Any:
    def run(*xs: torch.Tensor, other: Any = None, reverse: bool = False) -> torch.Tensor:
        if len(xs) == 2:
            return fn(xs[0], xs[1])
        return fn(other, xs[0]) if reverse else fn(xs[0], other)
    return run


def _mul_saves(i: Types, o: Types, a: dict[str, Any]) -> list[tuple[str, int]]:
    # x * y keeps both operands when both are tensors; x * scalar keeps nothing.
    return [("in", k) for k in range(len(i))] if len(i) == 2 else []


# ---- elementwise ---------------------------------------------------------------------------
elementwise("add", _binary(torch.add))
elementwise("sub", _binary(torch.sub))
register(OpDef("mul", "elementwise", lambda i, o, a: aligned_space(i, o), _binary(torch.mul),
               flops=lambda i, o, a: o[0].numel, saves=_mul_saves))
register(OpDef("div", "elementwise", lambda i, o, a: aligned_space(i, o), _binary(torch.div),
               flops=lambda i, o, a: o[0].numel, saves=_mul_saves))
elementwise("pow", _binary(torch.pow), saves="inputs")
def _extremum(fn: Any, clamp: Any) -> Any:
    """torch.maximum/minimum take two tensors; with a scalar `other` they are a clamp."""
    def run(a: Any, b: Any) -> torch.Tensor:
        if not isinstance(b, torch.Tensor):
            return clamp(a, b)
        return fn(a, b) if isinstance(a, torch.Tensor) else clamp(b, a)
    return run


elementwise("maximum", _binary(_extremum(torch.maximum, torch.clamp_min)), saves="inputs")
elementwise("minimum", _binary(_extremum(torch.minimum, torch.clamp_max)), saves="inputs")
elementwise("eq", _binary(torch.eq))
elementwise("ne", _binary(torch.ne))
elementwise("lt", _binary(torch.lt))
elementwise("le", _binary(torch.le))
elementwise("gt", _binary(torch.gt))
elementwise("ge", _binary(torch.ge))
elementwise("logical_and", _binary(torch.logical_and))
elementwise("logical_not", torch.logical_not)
elementwise("neg", torch.neg)
elementwise("abs", torch.abs, saves="inputs")
elementwise("exp", torch.exp, saves="output")
elementwise("log", torch.log, saves="inputs")
elementwise("sqrt", torch.sqrt, saves="output")
elementwise("rsqrt", torch.rsqrt, saves="output")
elementwise("reciprocal", torch.reciprocal, saves="output")
elementwise("sin", torch.sin, saves="inputs")
elementwise("cos", torch.cos, saves="inputs")
elementwise("tanh", torch.tanh, 4, saves="output")
elementwise("sigmoid", torch.sigmoid, 4, saves="output")
elementwise("erf", torch.erf, 4, saves="inputs")
elementwise("relu", F.relu, saves="output")
elementwise("silu", F.silu, 4, saves="inputs")
elementwise("gelu", lambda x, approximate="none": F.gelu(x, approximate=approximate), 8, saves="inputs")
elementwise("identity", lambda x: x.clone())
elementwise("cast", lambda x, dtype: x.to(torch_dtype(dtype)), 0)
def _where(cond: torch.Tensor, *xs: torch.Tensor, x: Any = None, y: Any = None) -> torch.Tensor:
    # Tensor branches are inputs in order; a scalar branch is the attribute x or y.
    rest = iter(xs)
    return torch.where(cond, x if x is not None else next(rest), y if y is not None else next(rest))


elementwise("where", _where)
elementwise("masked_fill", lambda x, mask, value: x.masked_fill(mask, value))
register(OpDef(
    "dropout", "elementwise", lambda i, o, a: aligned_space(i, o),
    lambda x, p, training=True: F.dropout(x, p, training),
    flops=lambda i, o, a: o[0].numel,
    # Backward needs the mask: one byte per element (Korthikanti et al. count it so).
    saves=lambda i, o, a: [("bytes", o[0].numel)] if a.get("p", 0) > 0 and a.get("training", True) else [],
    doc="inverted dropout; the mask is saved at one byte per element",
))


# ---- contractions --------------------------------------------------------------------------
def _linear_flops(i: Types, o: Types, a: dict[str, Any]) -> int:
    return 2 * o[0].numel * i[1].shape[1] + (o[0].numel if len(i) > 2 else 0)


register(OpDef(
    "linear", "contraction", "... k, n k, n -> ... n", lambda x, w, b=None: F.linear(x, w, b),
    flops=_linear_flops, saves=lambda i, o, a: [("in", 0), ("in", 1)], additive=(2,),
    doc="y = x @ w.T + b (torch.nn.Linear's layout); splitting k makes the bias partial too",
))


def _matmul_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    ra, rb = i[0].rank, i[1].rank
    if ra >= 2 and rb >= 2:
        return space_from_signature("... m k, ... k n -> ... m n", i, o)
    if rb == 1:
        return space_from_signature("... k, k -> ...", i, o)
    return space_from_signature("k, ... k n -> ... n", i, o)


register(OpDef(
    "matmul", "contraction", _matmul_space, torch.matmul,
    flops=lambda i, o, a: 2 * o[0].numel * i[0].shape[-1],
    saves=lambda i, o, a: [("in", 0), ("in", 1)],
))
register(OpDef(
    "embedding", "index", "..., v h -> ... h", lambda ids, w: F.embedding(ids, w),
    flops=lambda i, o, a: 0, saves=lambda i, o, a: [("in", 0)],
    doc="rows of w picked by ids; splitting v gives Partial(sum) (vocab-parallel embedding)",
))


# ---- normalisations, softmax, reductions ---------------------------------------------------
register(OpDef(
    "layer_norm", "norm", "... h, h, h -> ... h",
    lambda x, w=None, b=None, eps=1e-5: F.layer_norm(x, (x.shape[-1],), w, b, eps),
    unsplittable=frozenset({"h"}), flops=lambda i, o, a: 8 * o[0].numel,
    saves=lambda i, o, a: [("in", 0)] + [("bytes", 8 * math.prod(i[0].shape[:-1]))],
    doc="saves its input and per-row mean and rstd (fp32)",
))
register(OpDef(
    "rms_norm", "norm", "... h, h -> ... h",
    lambda x, w=None, eps=1e-6: F.rms_norm(x, (x.shape[-1],), w, eps),
    unsplittable=frozenset({"h"}), flops=lambda i, o, a: 4 * o[0].numel,
    saves=lambda i, o, a: [("in", 0)] + [("bytes", 4 * math.prod(i[0].shape[:-1]))],
))


def _softmax_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    return aligned_space(i, o, fixed=(a["dim"],))


register(OpDef("softmax", "norm", _softmax_space, lambda x, dim: torch.softmax(x, dim),
               flops=lambda i, o, a: 5 * o[0].numel, saves=lambda i, o, a: [("out", 0)],
               doc="the softmax axis cannot be split"))
register(OpDef("log_softmax", "norm", _softmax_space, lambda x, dim: torch.log_softmax(x, dim),
               flops=lambda i, o, a: 5 * o[0].numel, saves=lambda i, o, a: [("out", 0)]))


def _reduce_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    rank = i[0].rank
    names = dim_names(rank)
    dims = a.get("dim")
    reduced = set(range(rank)) if dims is None else {norm_dim(d, rank) for d in dims}
    keep = a.get("keepdim", False)
    out = tuple(((names[d],) if d not in reduced else ()) for d in range(rank) if keep or d not in reduced)
    return IterationSpace(tuple(zip(names, i[0].shape)), ((tuple((n,) for n in names)),), (out,),
                          partial_op=a.get("_partial", "sum"))


def _reduce_space_as(partial_op: str) -> Any:
    """A reduction whose split reduced dims leave its output Partial(partial_op)."""
    return lambda i, o, a: _reduce_space(i, o, {**a, "_partial": partial_op})


def _reducer(fn: Any) -> Any:
    def run(x: torch.Tensor, dim: Sequence[int] | None = None, keepdim: bool = False) -> torch.Tensor:
        return fn(x) if dim is None else fn(x, dim=tuple(dim), keepdim=keepdim)
    return run


for _name, _fn, _partial in (("sum", torch.sum, "sum"), ("mean", torch.mean, "avg"), ("amax", torch.amax, "max")):
    register(OpDef(_name, "reduction", _reduce_space_as(_partial), _reducer(_fn), flops=lambda i, o, a: i[0].numel,
                   saves=lambda i, o, a: [], doc=f"{_name} over `dim` (all dims when absent)"))


# ---- attention and loss --------------------------------------------------------------------
def _attention_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    q, k = i[0], i[1]
    groups = k.shape[-3] if k.rank >= 3 else 1
    heads = q.shape[-3] if q.rank >= 3 else 1
    if groups == heads:
        sig = "... g s d, ... g t d, ... g t e" + (", ... g s t" if len(i) > 3 else "") + " -> ... g s e"
    else:
        sig = "... (g r) s d, ... g t d, ... g t e" + (", ... 1 s t" if len(i) > 3 else "") + " -> ... (g r) s e"
    return space_from_signature(sig, i, o)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
          is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


register(OpDef(
    "scaled_dot_product_attention", "attention", _attention_space, _sdpa,
    unsplittable=frozenset({"d"}), rules=(("t", "ring"),),
    flops=lambda i, o, a: 2 * o[0].numel * i[0].shape[-1] // o[0].shape[-1] * i[1].shape[-2] + 2 * o[0].numel * i[1].shape[-2],
    # Flash-style backward keeps q, k, v, the output and one fp32 log-sum-exp per query row.
    saves=lambda i, o, a: [("in", 0), ("in", 1), ("in", 2), ("out", 0), ("bytes", 4 * o[0].numel // o[0].shape[-1])],
    doc="softmax(q k^T * scale + mask) v; the key dim t splits only as a rotation (ring attention)",
))


def _cross_entropy_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    lead = i[0].rank - 1
    names = dim_names(lead)
    sizes = tuple(zip(names, i[0].shape[:-1])) + (("v", i[0].shape[-1]),)
    logits = tuple((n,) for n in names) + (("v",),)
    targets = tuple((n,) for n in names)
    out = targets if a.get("reduction", "mean") == "none" else ()
    return IterationSpace(sizes, (logits, targets), (out,), special=(("v", "vocab"),),
                          partial_op="avg" if a.get("reduction", "mean") == "mean" else "sum")


register(OpDef(
    "cross_entropy", "loss", _cross_entropy_space,
    lambda x, t, ignore_index=-100, reduction="mean": F.cross_entropy(
        x.reshape(-1, x.shape[-1]), t.reshape(-1), ignore_index=ignore_index, reduction=reduction
    ).reshape(t.shape if reduction == "none" else ()),
    flops=lambda i, o, a: 5 * i[0].numel, saves=lambda i, o, a: [("in", 0), ("in", 1)],
    doc="mean over all leading dims; splitting the classes v needs max and sum-exp all-reduces",
))


# ---- creation ------------------------------------------------------------------------------
def _creation_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    names = dim_names(o[0].rank)
    return IterationSpace(tuple(zip(names, o[0].shape)), (), (tuple((n,) for n in names),), frozenset(names))


register(OpDef("arange", "creation", _creation_space,
               lambda start, end, step=1, dtype="i64": torch.arange(start, end, step, dtype=torch_dtype(dtype)),
               flops=lambda i, o, a: 0))
register(OpDef("full", "creation", _creation_space,
               lambda shape, value, dtype="f32": torch.full(tuple(shape), value, dtype=torch_dtype(dtype)),
               flops=lambda i, o, a: 0))


# ---- added by the torch frontend -----------------------------------------------------------
elementwise("logical_or", _binary(torch.logical_or))


def _opaque_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    """Every operand dim is its own iteration dim and none may be split: the op stays replicated."""
    sizes: list[tuple[str, int]] = []

    def dims(t: TensorType, prefix: str) -> tuple[tuple[str, ...], ...]:
        names = [f"{prefix}_{k}" for k in range(t.rank)]
        sizes.extend(zip(names, t.shape))
        return tuple((n,) for n in names)

    ins = tuple(dims(t, f"in{k}") for k, t in enumerate(i))
    outs = tuple(dims(t, f"out{k}") for k, t in enumerate(o))
    return IterationSpace(tuple(sizes), ins, outs, frozenset(d for d, _ in sizes))


def _opaque_impl(*tensors: torch.Tensor, target: str, args: Any = (), kwargs: Any = (), outputs: int = 1) -> Any:
    """Run the torch call an opaque node stands for: `$k` is input k, `$dtype:NAME` a torch dtype,
    `$device` the device of the first input."""
    fn = resolve_target(target)
    if fn is None:
        raise ValueError(f"opaque op: cannot import torch target {target!r}")
    device = tensors[0].device if tensors else torch.device("cpu")

    return fn(*decode_operands(tuple(args), tensors, device), **{k: decode_operands(v, tensors, device) for k, v in kwargs})


register(OpDef(
    "opaque", "opaque", _opaque_space, _opaque_impl, flops=lambda i, o, a: 0,
    saves=lambda i, o, a: [("in", k) for k in range(len(i))], num_outputs=lambda a: a.get("outputs", 1),
    doc="a torch call with no registry entry (traced with allow_opaque): runs as `target`, never split",
))


def _gather_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    """out[..., j, ...] = x[..., index[..., j, ...], ...] along `dim`: output dims follow the index;
    x's `dim` (read at data-dependent positions) and any x dim longer than the index cannot split."""
    rank = o[0].rank
    d = norm_dim(a["dim"], rank)
    names = dim_names(rank)
    sizes = list(zip(names, o[0].shape))
    x_dims: list[tuple[str, ...]] = []
    fixed: set[str] = set()
    for k in range(rank):
        if k != d and i[0].shape[k] == o[0].shape[k]:
            x_dims.append((names[k],))
        else:
            sizes.append((f"src{k}", i[0].shape[k]))
            x_dims.append((f"src{k}",))
            fixed.add(f"src{k}")
    index_dims = tuple((n,) for n in names)
    return IterationSpace(tuple(sizes), (tuple(x_dims), index_dims), (index_dims,), frozenset(fixed))


register(OpDef(
    "gather", "index", _gather_space, lambda x, index, dim: torch.gather(x, dim, index),
    flops=lambda i, o, a: 0, saves=lambda i, o, a: [("in", 1)],
    doc="torch.gather: out takes the index's shape; x's gathered dim cannot be split",
))
register(OpDef(
    "cumsum", "elementwise", lambda i, o, a: aligned_space(i, o, fixed=(a["dim"],)),
    lambda x, dim: torch.cumsum(x, dim), flops=lambda i, o, a: o[0].numel, saves=lambda i, o, a: [],
    doc="running sum along dim (integers widen to i64 as in torch); a scan: that dim cannot be split",
))
