"""One vocabulary for element types: their names, aliases, sizes and torch dtypes.

A dtype has three spellings: the IR's short name (`f32`, `bf16`, `i64`: what the printer
prints and `TensorType` holds), the precision name plans and data sheets use (`fp32`, `bf16`,
`fp16`: `dtype=` in a plan, the keys of a device's peak FLOP/s table) and torch's (`float32`,
`bfloat16`, `half`). Every spelling resolves through one alias table: `ir_dtype` gives the IR
name, `precision` the plan's, `torch_dtype` the torch dtype (torch is imported on first use,
so the IR layer loads without it). Data sheets also list precisions no tensor is stored in
(`tf32`, `fp8`): `precision` and `element_bytes` know them, `ir_dtype` does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class DType:
    """One element type: its IR name, size, whether it is a float, and its other spellings."""

    name: str
    nbytes: int
    is_float: bool
    torch_name: str
    precision: str | None = None  # the plan's and data sheets' name; None for integers


_TABLE = (
    DType("f64", 8, True, "float64", "fp64"),
    DType("f32", 4, True, "float32", "fp32"),
    DType("f16", 2, True, "float16", "fp16"),
    DType("bf16", 2, True, "bfloat16", "bf16"),
    DType("i64", 8, False, "int64"),
    DType("i32", 4, False, "int32"),
    DType("i16", 2, False, "int16"),
    DType("i8", 1, False, "int8"),
    DType("u8", 1, False, "uint8"),
    DType("bool", 1, False, "bool"),
)
DTYPES: Mapping[str, DType] = MappingProxyType({d.name: d for d in _TABLE})
DTYPE_BYTES: Mapping[str, int] = MappingProxyType({d.name: d.nbytes for d in _TABLE})
FLOAT_DTYPES = frozenset(d.name for d in _TABLE if d.is_float)

# Compute dtypes a plan may name (`dtype=`), in the order `PLAN_KEYS` prints them.
PLAN_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
# Precisions of a device's peak table that no tensor is stored in, with their element bytes.
_COMPUTE_ONLY: Mapping[str, int] = MappingProxyType({"tf32": 4, "fp8": 1})

# Every spelling -> the IR name.
_ALIASES: Mapping[str, str] = MappingProxyType({
    **{d.name: d.name for d in _TABLE}, **{d.torch_name: d.name for d in _TABLE},
    **{d.precision: d.name for d in _TABLE if d.precision}, "half": "f16",
})


def ir_dtype(name: str) -> str:
    """The IR's name for any spelling of a tensor dtype: `fp32`/`float32` -> `f32`, `half` -> `f16`."""
    try:
        return _ALIASES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)} "
                         f"(or {', '.join(sorted(set(_ALIASES) - set(DTYPES)))})") from None


def precision(name: str) -> str:
    """The plan's and data sheets' name: `f32`/`float32` -> `fp32`, `half` -> `fp16`; a name that
    is no float dtype (`tf32`, an integer type, an unknown one) comes back lowercased."""
    key = name.strip().lower()
    dtype = DTYPES.get(_ALIASES.get(key, ""))
    return dtype.precision if dtype is not None and dtype.precision else key


def element_bytes(name: str) -> int:
    """Bytes per element of any spelling, compute-only precisions (`tf32`, `fp8`) included."""
    key = precision(name)
    return _COMPUTE_ONLY[key] if key in _COMPUTE_ONLY else DTYPES[ir_dtype(key)].nbytes


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of any spelling (`f32`, `fp32`, `float32` -> `torch.float32`)."""
    import torch

    dtype: torch.dtype = getattr(torch, DTYPES[ir_dtype(name)].torch_name)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The IR's name of a torch dtype; KeyError for one the IR has no name for (complex, fp8)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _ALIASES:
        raise KeyError(f"torch dtype {dtype} has no IR name (known: {', '.join(DTYPES)})")
    return _ALIASES[name]
