"""`shardc.analysis.dims.batch_scale`: how a traced batch stands for a plan's micro-batch, the one
rule the cost model (`graph_batch_scale`) and the solver's pricing (`batch_scale`) read."""

from __future__ import annotations

from shardc.analysis.dims import BatchScale, batch_scale, graph_batch_scale
from shardc.ir.parser import parse

PARTITIONED = """\
graph @tp mesh<dp=2, tp=2> {
  input %x : f32[6,16]{dp:S(0), tp:S(0)}
  param %w : f32[16,16]
  %y = linear(%x, %w) : f32[6,16] @fc
  return %y
}
"""


def test_an_even_split() -> None:
    # 8 traced sequences over 4 replicas: 2 per device stand for mb=4, and the whole traced
    # batch for the 16 sequences of one micro-batch of every replica.
    s = batch_scale(8, 4, 4)
    assert (s.local, s.factor, s.global_factor) == (2, 2.0, 2.0)


def test_a_traced_batch_smaller_than_dp_is_still_costed_at_mb() -> None:
    s = batch_scale(2, 1, 8)
    assert s.local == 1 and s.factor == 1.0 and s.global_factor == 4.0


def test_graph_reads_the_split_off_the_first_input() -> None:
    # dp and tp both cut the batch: ceil(ceil(6/2)/2) = 2 traced sequences per device; tp is a
    # model axis, so each device holds mb/2 of the micro-batch.
    s = graph_batch_scale(parse(PARTITIONED), 4)
    assert s == BatchScale(traced=6, mb=4, replicas=2, local=2, model=2)
    assert s.factor == 4 / 2 / 2


def test_a_graph_without_inputs_is_taken_at_the_micro_batch() -> None:
    graph = parse("graph @c {\n  param %w : f32[4]\n  %y = neg(%w) : f32[4] @\n  return %y\n}\n")
    s = graph_batch_scale(graph, 3)
    assert s.traced == 3 and s.factor == 1.0
