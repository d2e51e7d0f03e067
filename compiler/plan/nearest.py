"""The nearest valid values a plan error names: divisors of a dimension, the values nearest a
target, and the global batches and micro-batch sizes that fit a data-parallel degree."""

from __future__ import annotations

import math


def divisors(n: int) -> list[int]:
    """Every divisor of `n`, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest(values: list[int], target: int, k: int = 4) -> list[int]:
    """The `k` of `values` nearest `target` (the smaller first on a tie), ascending."""
    return sorted(sorted(values, key=lambda v: (abs(v - target), v))[:k])


def batch_suggestions(gbs: int, dp: int, mb: int) -> str:
    """The valid global batches nearest `gbs` for dp*mb, and the valid micro-batch sizes for `gbs`."""
    per = dp * mb
    lo, hi = gbs // per * per, -(-gbs // per) * per
    near = " and ".join(str(v) for v in (lo, hi) if v > 0)
    text = f"nearest valid gbs: {near}"
    if gbs % dp == 0:
        text += f"; with gbs={gbs}, valid mb: {', '.join(map(str, nearest(divisors(gbs // dp), mb, 6)))}"
    return text
