"""The LM head and its loss over token chunks (`shardc.analysis.head_loss`): the fused autograd
node against the unfused ops, the graph pattern that runs it, and the solver's own pricing of a
chunked head against `estimate`. Multi-process numerics: `tests/test_backend_numerics.py`
(`head-chunks` edits, data- and vocabulary-parallel); solver-chosen: `tests/test_closed_loop.py`
(`gpt-chunks`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardc
from shardc.analysis.groups import build_groups
from shardc.analysis.head_loss import head_chain
from shardc.backends.torch.collectives import MeshGroups
from shardc.backends.torch.fused_loss import chunked_linear_cross_entropy
from shardc.backends.torch.local_ops import vocab_parallel_cross_entropy
from shardc.cost import estimate
from shardc.driver import load
from shardc.hardware import parse_cluster
from shardc.ir import Partition, TemporalSplit
from shardc.search.evaluate import Assignment, evaluate
from shardc.search.grid import grid_assignments
from shardc.search.objective import objective
from shardc.search.planfile import annotate_graph
from shardc.search.problem import MeshShape, build_problem, graph_facts

GPT = "examples/gpt.py:tiny?batch=4&seq=32&vocab_size=512&tie=false"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_linear_cross_entropy_is_the_unfused_loss_and_gradients(bias: bool, reduction: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 12, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True) if bias else None
    t = torch.randint(0, 50, (48,))
    t[3] = t[17] = -100  # ignored rows: the mean is over the counted rows of all chunks
    leaves = [x, w] + ([b] if b is not None else [])
    want = F.cross_entropy(F.linear(x, w, b).reshape(-1, 50), t, reduction=reduction)
    got = chunked_linear_cross_entropy(x, w, b, t, 4, reduction=reduction)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, h in zip(torch.autograd.grad(1.7 * got, leaves), torch.autograd.grad(1.7 * want, leaves)):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="48 token rows of x .* but 47 targets"):
        chunked_linear_cross_entropy(x, w, b, t[:47], 4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy_is_the_loss_and_keeps_one_softmax(reduction: str) -> None:
    """The unfused vocabulary-parallel loss (`local_ops.vocab_parallel_cross_entropy`, here on an
    axis of one: its collectives are the identity; split over ranks: `test_backend_numerics`'s
    tp plans) is cross entropy, and saves one logits-sized tensor (its softmax) and the targets,
    as `shardc.cost.head.vocab_parallel_loss` prices it."""
    torch.manual_seed(0)
    logits = torch.randn(4, 12, 50, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (4, 12))
    t[0, 3] = t[2, 5] = -100
    want = F.cross_entropy(logits.reshape(-1, 50), t.reshape(-1), reduction=reduction).reshape(
        t.shape if reduction == "none" else ())
    saved: list[torch.Tensor] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x)
        return x

    mesh = MeshGroups({"tp": 1}, {"tp": 0})
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        got = vocab_parallel_cross_entropy(logits * 1.0, t, mesh, "tp", 0, reduction=reduction)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    outer = torch.randn(got.shape, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad((got * outer).sum(), logits)[0],
                               torch.autograd.grad((want * outer).sum(), logits)[0], rtol=1e-12, atol=1e-12)
    big = [x for x in saved if x.numel() == logits.numel()]
    assert len(big) == 1 and big[0].untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
    assert sum(x.numel() for x in saved if x.numel() < logits.numel()) <= t.numel() + 1  # the targets, the count


def test_the_loss_joins_its_head_and_the_chunked_head_runs_fused() -> None:
    graph = load(GPT, batch=4)
    users = graph.users()
    loss = next(n for n in graph.nodes if n.op == "cross_entropy")
    chain = head_chain(loss, users, graph.outputs)
    assert chain is not None and chain[0].location.module_path == "lm_head" and [v.op for v in chain[1]] == ["reshape"]
    group = next(g for g in build_groups(graph) if loss in g.members)
    assert group.anchor is chain[0]  # chosen together: the head's chunks reach its loss

    def chunk(g: object) -> None:
        head = next(n for n in g.nodes if n.location.module_path == "lm_head")  # type: ignore[attr-defined]
        head.partition = Partition(head.partition.spatial, (TemporalSplit("e1", 4),))

    code = shardc.compile(GPT, plan="dp=2,tp=2,dtype=fp32", before_lower=chunk, device="meta").code(0)
    assert "chunked_linear_cross_entropy(" in code and "axis = 'tp'" in code  # vocabulary-parallel, fused
    assert "shardc_ops_builtin_linear(x63" not in code and "vocab_parallel_cross_entropy" not in code
    plain = shardc.compile(GPT, plan="dp=2,tp=2,dtype=fp32", device="meta").code(0)
    assert "chunked_linear_cross_entropy" not in plain and "vocab_parallel_cross_entropy" in plain


def test_the_solver_prices_a_chunked_head_as_estimate_does() -> None:
    graph = load(GPT, batch=4)
    cluster = parse_cluster("8xA100-80GB")
    problem = build_problem(graph_facts(graph, cluster, dtype="fp32", compiled=False), cluster, MeshShape(1, 1, 1, 2),
                            2, 4, dtype="fp32")
    _, base = next(iter(grid_assignments(problem)))
    head = next(i for i, v in enumerate(problem.groups) if v.group.members[-1].op == "cross_entropy")
    labels = [c.label for c in problem.groups[head].cands]
    results = {}
    for label in ("partition<tp:n>", "partition<tp:n; time e1/4>"):
        choice = list(base.choice)
        choice[head] = labels.index(label)
        a = Assignment(tuple(choice), base.stages, base.zero)
        ev = evaluate(problem, a, float("inf"))
        est = estimate(annotate_graph(graph, problem, a), cluster)
        assert ev.step_time_s == pytest.approx(est.step_time_s, rel=0.01)
        assert ev.memory_per_device_bytes == pytest.approx(est.memory_per_device_bytes, rel=0.01)
        lin = objective(problem, a.choice, a.stages, a.zero)
        assert lin.step_time_s == pytest.approx(est.step_time_s, rel=0.03)
        assert lin.memory_bytes[0] == pytest.approx(est.memory_per_device_bytes, rel=0.05)
        results[label] = est
    chunked, whole = results["partition<tp:n; time e1/4>"], results["partition<tp:n>"]
    # the softmax the unfused vocabulary-parallel loss keeps in the logits' place (32 tokens x 2
    # sequences x 256 classes, fp32: 64 KiB) leaves the saved activations, one chunk's logits the
    # working set; at the peak 47 KiB less (64 KiB before that loss wrote its gradient over its
    # softmax, `cost.head.vocab_parallel_loss`); the head's matmul runs once more in backward
    assert chunked.memory_per_device_bytes < whole.memory_per_device_bytes - 32 * 1024
    assert chunked.step_time_s > whole.step_time_s
