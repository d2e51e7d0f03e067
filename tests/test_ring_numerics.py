"""Load-balanced (zig-zag) causal context parallelism on real gloo process groups.

The Llama example (ring attention: sdpa with is_causal) and the GPT example (explicit-matmul
attention: keys all-gathered, position embeddings chunked, both on zig-zag shards) train for
3 AdamW steps under `cp=N:zigzag` plans on 2 and 4 CPU processes; the loss at every step and
every parameter afterwards match one process within 1e-5 relative (fp32), as in
`test_backend_numerics.py`. In the same process groups `ring_attention` itself is checked
against full attention (forward and input gradients) for both layouts, causal or not, with
grouped-query heads and with a boolean mask, and the collectives on zig-zag shards against the
full tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import pytest
import torch
from test_backend_numerics import GPT, LLAMA, compile_case, reference, run_cases

from shardc.backends.torch.launch import spawn


@contextmanager
def _counting_scores() -> Iterator[list[int]]:
    """Record the size of every score block ring attention folds into its softmax."""
    from shardc.backends.torch import ring

    scored: list[int] = []
    add = ring._Softmax.add

    def counted(self: object, scores: torch.Tensor, values: torch.Tensor) -> None:
        scored.append(scores.shape[-2] * scores.shape[-1])
        add(self, scores, values)  # type: ignore[arg-type]

    ring._Softmax.add = counted  # type: ignore[method-assign, assignment]
    try:
        yield scored
    finally:
        ring._Softmax.add = add  # type: ignore[method-assign]


def _ring_cases(rank: int, world: int) -> list[str]:
    """Compare ring attention on this rank's shards with full attention; returns failures."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardc.backends.torch.collectives import MeshGroups
    from shardc.backends.torch.ring import ring_attention, take
    from shardc.cost.ring import causal_ring_blocks

    mesh = MeshGroups({"cp": world}, {"cp": rank}, {"cp": dist.group.WORLD})
    failures = []
    seq = 8 * world
    for zigzag in (False, True):
        for causal, kv_heads, with_mask in ((True, 4, False), (True, 2, False), (False, 4, False), (True, 4, True)):
            g = torch.Generator().manual_seed(7)
            q, k, v = (torch.randn(2, h, seq, 8, generator=g, dtype=torch.float64) for h in (4, kv_heads, kv_heads))
            mask = torch.rand(seq, seq, generator=g) > 0.3 if with_mask else None
            if mask is not None:
                mask |= torch.eye(seq, dtype=torch.bool)  # no fully masked row
            q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
            full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  enable_gqa=kv_heads != 4)
            if causal and mask is not None:
                full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask & torch.ones(seq, seq).tril().bool())
            weight = torch.randn(full.shape, generator=g, dtype=torch.float64)
            want = torch.autograd.grad((full * weight).sum(), (q, k, v))

            def mine(x: torch.Tensor, zz: bool = zigzag) -> torch.Tensor:
                return take(x.detach(), world, rank, 2, 1, zz).requires_grad_(True)

            lq, lk, lv = mine(q), mine(k), mine(v)
            local_mask = take(mask, world, rank, 0, 1, zigzag) if mask is not None else None
            with _counting_scores() as scored:  # query x key pairs this rank computes scores for
                out = ring_attention(lq, lk, lv, local_mask, mesh=mesh, axis="cp", is_causal=causal,
                                     enable_gqa=kv_heads != 4, zigzag=zigzag,
                                     q_offset=None if zigzag else rank * lq.shape[-2])
            chunk = seq // (2 * world)  # the work the cost model charges this rank (cost/ring.py)
            blocks = causal_ring_blocks(world, zigzag)[rank] if causal else world
            if sum(scored) != blocks * (2 * chunk) ** 2:
                failures.append(f"zigzag={zigzag} causal={causal}: {sum(scored)} scores, expected {blocks} blocks")
            got = torch.autograd.grad((out * take(weight, world, rank, 2, 1, zigzag)).sum(), (lq, lk, lv))
            name = f"zigzag={zigzag} causal={causal} kv_heads={kv_heads} mask={with_mask}"
            if not torch.allclose(out, take(full.detach(), world, rank, 2, 1, zigzag), atol=1e-10):
                failures.append(f"{name}: output")
            for label, g_got, g_want in zip("qkv", got, want):
                if not torch.allclose(g_got, take(g_want, world, rank, 2, 1, zigzag), atol=1e-10):
                    failures.append(f"{name}: grad {label}")
    return failures


def _collective_cases(rank: int, world: int) -> list[str]:
    """Collectives on zig-zag shards against the full tensor (forward; all_gather's backward)."""
    import torch.distributed as dist

    from shardc.backends.torch import ring as R
    from shardc.backends.torch.collectives import MeshGroups, all_reduce

    mesh = MeshGroups({"cp": world}, {"cp": rank}, {"cp": dist.group.WORLD})
    g = torch.Generator().manual_seed(3)
    x, w = (torch.randn(4, 4 * world, 3, generator=g, dtype=torch.float64) for _ in range(2))

    def mine(t: torch.Tensor, dim: int = 1, interleave: int = 1, zigzag: bool = True) -> torch.Tensor:
        return R.take(t, world, rank, dim, interleave, zigzag)

    failures = []
    for k in (1, 2):
        local = mine(x, 1, k).requires_grad_(True)
        full = R.zigzag_all_gather(local, mesh, "cp", 1, grad="chunk", interleave=k)
        grad = torch.autograd.grad((full * w).sum(), local)[0]
        checks = {
            f"all_gather/{k}": torch.equal(full, x), f"all_gather/{k} backward": torch.equal(grad, mine(w, 1, k)),
            f"chunk/{k}": torch.equal(R.zigzag_chunk(x, mesh, "cp", 1, interleave=k), mine(x, 1, k)),
            f"reduce_scatter/{k}": torch.allclose(R.zigzag_reduce_scatter(x * (rank + 1), mesh, "cp", 1, interleave=k),
                                                  mine(x, 1, k) * world * (world + 1) / 2),
            f"pad/{k}": torch.allclose(all_reduce(R.zigzag_pad(mine(x, 1, k), mesh, "cp", 1, interleave=k), mesh, "cp"),
                                       x),
        }
        failures += [name for name, ok in checks.items() if not ok]
    to_batch = R.zigzag_all_to_all(mine(x), mesh, "cp", 1, 0, src_zigzag=True)
    from_batch = R.zigzag_all_to_all(mine(x, 0, zigzag=False), mesh, "cp", 0, 1, dst_zigzag=True)
    reorder = R.zigzag_all_to_all(mine(x), mesh, "cp", 1, 1, src_zigzag=True)
    failures += [name for name, ok in (("all_to_all S(1, zigzag)->S(0)", torch.equal(to_batch, mine(x, 0, zigzag=False))),
                                       ("all_to_all S(0)->S(1, zigzag)", torch.equal(from_batch, mine(x))),
                                       ("all_to_all S(1, zigzag)->S(1)", torch.equal(reorder, mine(x, zigzag=False))))
                 if not ok]
    return failures


def _child(rank: int, world: int, cases: list) -> tuple[list[str], list]:
    return _ring_cases(rank, world) + _collective_cases(rank, world), run_cases(rank, world, cases)


def _run(world: int, cases: list[tuple[str, str]]) -> None:
    compiled = [(spec, compile_case(spec, plan, ""), "") for spec, plan in cases]
    results = spawn(_child, world, compiled, timeout_s=600)
    for rank, (failures, _) in enumerate(results):
        assert failures == [], f"rank {rank}: ring attention or zig-zag collectives differ: {failures}"
    for (spec, plan), result in zip(cases, results[0][1]):
        assert not isinstance(result, str), f"{spec} {plan}: {result}"
        losses, full = result
        ref_losses, ref_state = _reference(spec)
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"{spec} {plan}: losses {losses} vs {ref_losses}"
        for name, want in ref_state.items():  # as test_backend_numerics.check, with the reference cached
            torch.testing.assert_close(full[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name, p=plan: f"{p} {n}: {m}")


@cache
def _reference(spec: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference(spec)


def test_zigzag_context_parallel_two_processes_matches_one() -> None:
    _run(2, [(LLAMA, "cp=2:zigzag"), (GPT, "cp=2:zigzag")])


def test_zigzag_context_parallel_four_processes_matches_one() -> None:
    _run(4, [(LLAMA, "cp=4:zigzag"), (LLAMA, "cp=2:zigzag,tp=2,recompute=full")])
