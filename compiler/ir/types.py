"""The partition IR's values: tensor types, placements, layouts, meshes and partitions.

Values that never change (types, placements, layouts, meshes, partitions, locations, layer
annotations) are frozen dataclasses that check themselves. Nodes are mutable and compare by
identity; a `Graph` is an ordered list of nodes plus its inputs, parameters, buffers, outputs
and per-layer annotations. Structural equality of whole graphs lives in `shardc.ir.equality`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from shardc.ir.dtypes import DTYPE_BYTES, FLOAT_DTYPES

VALUE_KINDS: tuple[str, ...] = ("input", "parameter", "buffer", "activation")
# Activation recomputation of a layer: keep every activation, recompute the attention core
# (selective), or keep only the layer's input and run its forward again in backward (full).
RECOMPUTE_CHOICES: tuple[str, ...] = ("none", "selective", "full")
# ZeRO stages over the data axes: 0 replicates, 1 shards optimizer states, 2 also gradients,
# 3 also weights (FSDP).
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)


@dataclass(frozen=True, slots=True)
class TensorType:
    """A static shape and a dtype, printed `f32[8,1024,768]` (a scalar is `f32[]`)."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ValueError(f"shape {self.shape} must be non-negative integers")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


# ---- placements: the torch.distributed.tensor vocabulary --------------------------------

@dataclass(frozen=True, slots=True)
class Shard:
    """The tensor is split along `dim` across the mesh axis.

    With `interleave=k` (printed `S(dim/k)`) the dim, as this axis sees it, is `k` equal blocks
    and every device holds its 1/size piece of each block (a strided shard): the q, k and v
    heads of a fused qkv projection, or the sequence inside a flattened `(batch seq)` dim.

    With `zigzag` (printed `S(dim, zigzag)`, `S(dim/k, zigzag)`) each block is cut into
    2*size equal chunks and device c holds chunks c and 2*size-1-c, in that order: the
    load-balanced sequence layout of causal context parallelism (every device holds as many
    early as late positions, so causal attention costs every device the same).
    """

    dim: int
    interleave: int = 1
    zigzag: bool = False

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard dim must be non-negative, got {self.dim}")
        if self.interleave < 1:
            raise ValueError(f"Shard interleave must be >= 1, got {self.interleave}")

    def __str__(self) -> str:
        text = str(self.dim) if self.interleave == 1 else f"{self.dim}/{self.interleave}"
        return f"S({text}, zigzag)" if self.zigzag else f"S({text})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every device along the mesh axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    """Every device holds a partial value; the true value is their reduction by `op`."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in ("sum", "max", "avg"):
            raise ValueError(f"Partial op must be sum, max or avg, got {self.op!r}")

    def __str__(self) -> str:
        return f"P({self.op})"


Placement = Shard | Replicate | Partial


@dataclass(frozen=True, slots=True)
class Layout:
    """Per mesh axis, how a tensor is placed; axes not named are `Replicate()`.

    Kept sorted by axis name's position in the mesh by whoever builds it, printed
    `{dp:S(0), tp:P(sum)}`; the empty layout `{}` means replicated everywhere.
    """

    placements: tuple[tuple[str, Placement], ...] = ()

    def __post_init__(self) -> None:
        axes = [a for a, _ in self.placements]
        if len(set(axes)) != len(axes):
            raise ValueError(f"layout names a mesh axis twice: {axes}")

    def on(self, axis: str) -> Placement:
        for a, p in self.placements:
            if a == axis:
                return p
        return Replicate()

    def sharded_dims(self) -> dict[int, list[str]]:
        """Tensor dim -> the mesh axes splitting it, in layout order (outermost first)."""
        out: dict[int, list[str]] = {}
        for a, p in self.placements:
            if isinstance(p, Shard):
                out.setdefault(p.dim, []).append(a)
        return out

    def local_shape(self, shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
        """The shape one device holds (ceil division, as torch's Shard does)."""
        local = list(shape)
        for a, p in self.placements:
            if isinstance(p, Shard):
                size = mesh.axis_size(a)
                block = -(-local[p.dim] // p.interleave)
                local[p.dim] = p.interleave * -(-block // size)
        return tuple(local)

    def without_replicate(self) -> Layout:
        return Layout(tuple((a, p) for a, p in self.placements if not isinstance(p, Replicate)))

    def __str__(self) -> str:
        return "{" + ", ".join(f"{a}:{p}" for a, p in self.placements) + "}"


# ---- meshes, partitions, locations ---------------------------------------------------------

class Axis(StrEnum):
    """The roles of the mesh axes plans build. A member is its own name (`Axis.TP == "tp"`, and
    it hashes, prints and serialises as "tp"), so a mesh, layout or partition may hold either;
    a mesh may name other axes too."""

    PP = "pp"  # pipeline: stages of the model on different devices
    DP = "dp"  # data: replicas (or ZeRO shards) of the model on different samples
    CP = "cp"  # context: the sequence split, attention as a ring
    TP = "tp"  # tensor: Megatron's column- and row-parallel linears, heads split
    EP = "ep"  # expert: an MoE layer's experts split, tokens dispatched by all-to-all; the batch elsewhere
    TQ = "tq"  # the second tensor axis of a q x q device grid (PrimePar), beside tp

    def __repr__(self) -> str:
        return repr(self.value)  # messages and dataclass reprs read as they did with plain names


# Axes whose ranks hold different samples or positions of one step: their gradients are
# partial (each rank's own loss) and ZeRO shards over them.
DATA_AXES: tuple[Axis, ...] = (Axis.DP, Axis.CP)


@dataclass(frozen=True, slots=True)
class Mesh:
    """Named mesh axes with sizes, outermost first, e.g. `mesh<pp=2, dp=4, tp=8>`.

    Plans name the axes by role (`Axis`); `degree(Axis.TP)` is 1 on a mesh without that axis.
    """

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [a for a, _ in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh names an axis twice: {names}")
        for name, size in self.axes:
            if not name.isidentifier():
                raise ValueError(f"mesh axis name {name!r} must be an identifier")
            if size < 1:
                raise ValueError(f"mesh axis {name} has size {size}; sizes must be >= 1")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @property
    def size(self) -> int:
        n = 1
        for _, s in self.axes:
            n *= s
        return n

    def axis_size(self, axis: str) -> int:
        for a, s in self.axes:
            if a == axis:
                return s
        raise KeyError(f"mesh {self} has no axis {axis!r}; its axes are {', '.join(self.names) or 'none'}")

    def degree(self, axis: str) -> int:
        """The size of `axis`, 1 when the mesh has no such axis (a plan without that parallelism)."""
        for a, s in self.axes:
            if a == axis:
                return s
        return 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """Row-major coordinates of a flat rank (the last axis varies fastest)."""
        coords: dict[str, int] = {}
        for name, size in reversed(self.axes):
            coords[name] = rank % size
            rank //= size
        return dict(reversed(list(coords.items())))

    def __str__(self) -> str:
        return "mesh<" + ", ".join(f"{a}={s}" for a, s in self.axes) + ">"


@dataclass(frozen=True, slots=True)
class TemporalSplit:
    """An iteration dim cut into `steps` pieces computed one after another on the same devices.

    With `rotate` set, the piece a device works on moves one neighbour along that mesh axis per
    step (PrimePar's temporal primitive; ring attention is the same idea), so partial results
    accumulate locally instead of through a collective. With `grid` set as well (printed
    `k/2 rotate (tp, tq)`), the two axes form PrimePar's q x q device grid P(q x q): operands
    sharded on `dim` along either axis move along it, skewed so device (r, c) starts on piece
    r + c (see `shardc.cost.grid2d`).
    """

    dim: str
    steps: int
    rotate: str | None = None
    grid: str | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"temporal split of {self.dim} needs steps >= 1, got {self.steps}")
        if self.grid is not None and (self.rotate is None or self.grid == self.rotate):
            raise ValueError(f"a grid split of {self.dim} needs two distinct mesh axes, got {self.rotate}, {self.grid}")

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes operands rotate along: none, one, or the two of a grid."""
        return tuple(a for a in (self.rotate, self.grid) if a is not None)

    def __str__(self) -> str:
        if self.grid is not None:
            return f"{self.dim}/{self.steps} rotate ({self.rotate}, {self.grid})"
        return f"{self.dim}/{self.steps}" + (f" rotate {self.rotate}" if self.rotate else "")


@dataclass(frozen=True, slots=True)
class Partition:
    """How one node's iteration space is cut: in space (mesh axis -> iteration dim) and in time.

    Printed `partition<dp:b, tp:n; time k/4 rotate tp>`. `strides` gives, per mesh axis, a
    strided split (printed `tp:n/3`): the axis cuts its dim as 3 equal blocks and every device
    takes its piece of each block, so the operands indexing the dim are `Shard(i, interleave=3)`.
    Mesh axes in `zigzag` (printed `cp:s zigzag`) split their dim zig-zag: the operands are
    `Shard(i, zigzag=True)` (see `Shard`).
    """

    spatial: tuple[tuple[str, str], ...] = ()
    temporal: tuple[TemporalSplit, ...] = ()
    strides: tuple[tuple[str, int], ...] = ()
    zigzag: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        axes = [a for a, _ in self.spatial]
        if len(set(axes)) != len(axes):
            raise ValueError(f"partition assigns a mesh axis twice: {axes}")
        for axis, stride in self.strides:
            if axis not in axes or stride < 2:
                raise ValueError(f"partition stride {axis}/{stride} needs a spatial split on {axis} and stride >= 2")
        for axis in self.zigzag:
            if axis not in axes:
                raise ValueError(f"partition zigzag on {axis} needs a spatial split on {axis}")

    def axes_of(self, dim: str) -> list[str]:
        return [a for a, d in self.spatial if d == dim]

    def stride_of(self, axis: str) -> int:
        """The number of interleaved blocks `axis` cuts its dim into (1: a plain split)."""
        return dict(self.strides).get(axis, 1)

    def __str__(self) -> str:
        body = ", ".join(f"{a}:{d}" + (f"/{self.stride_of(a)}" if self.stride_of(a) > 1 else "")
                         + (" zigzag" if a in self.zigzag else "") for a, d in self.spatial)
        if self.temporal:
            body += "; time " + ", ".join(str(t) for t in self.temporal)
        return f"partition<{body}>"
