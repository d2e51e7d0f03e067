"""redistribute: every pair of placements on one axis with exact per-device bytes, orders across
axes, strided shards, conjugates and backward steps."""

from __future__ import annotations

import pytest

from shardc.analysis.resharding import ReshardStep, backward_step, conjugate, redistribute
from shardc.ir import Layout, Mesh, Partial, Replicate, Shard, TensorType
from shardc.ir.diagnostics import ShardcError

MESH = Mesh((("dp", 2), ("tp", 4)))
T = TensorType((8, 12), "f32")  # 384 bytes whole; a quarter (one tp shard) is 96
R, P = Replicate(), Partial("sum")


def lay(**placements: object) -> Layout:
    return Layout(tuple((a, placements[a]) for a in MESH.names if a in placements))  # type: ignore[misc]


# (src, dst) on tp -> (kind, bytes in, bytes out, wire bytes) or None for no step.
ONE_AXIS = {
    (R, R): None,
    (R, P): ("to_partial", 384, 384, 0),
    (R, Shard(0)): ("chunk", 384, 96, 0),
    (R, Shard(1)): ("chunk", 384, 96, 0),
    (P, R): ("all_reduce", 384, 384, 576),
    (P, P): None,
    (P, Shard(0)): ("reduce_scatter", 384, 96, 288),
    (P, Shard(1)): ("reduce_scatter", 384, 96, 288),
    (Shard(0), R): ("all_gather", 96, 384, 288),
    (Shard(0), P): ("pad", 96, 384, 0),
    (Shard(0), Shard(0)): None,
    (Shard(0), Shard(1)): ("all_to_all", 96, 96, 72),
    (Shard(1), R): ("all_gather", 96, 384, 288),
    (Shard(1), P): ("pad", 96, 384, 0),
    (Shard(1), Shard(0)): ("all_to_all", 96, 96, 72),
    (Shard(1), Shard(1)): None,
    (Shard(1, 3), Shard(1)): ("all_to_all", 96, 96, 72),
    (Shard(1, 3), R): ("all_gather", 96, 384, 288),
    (R, Shard(1, 3)): ("chunk", 384, 96, 0),
}


@pytest.mark.parametrize(("src", "dst"), list(ONE_AXIS), ids=[f"{a}->{b}" for a, b in ONE_AXIS])
def test_every_pair_of_placements(src: object, dst: object) -> None:
    steps = redistribute(lay(tp=src), lay(tp=dst), T, MESH)
    expected = ONE_AXIS[(src, dst)]  # type: ignore[index]
    if expected is None:
        assert steps == []
        return
    kind, nin, nout, wire = expected
    assert len(steps) == 1
    (step,) = steps
    assert (step.kind, step.axis, step.bytes_in_per_device, step.bytes_out_per_device, step.group_size) == (
        kind, "tp", nin, nout, 4)
    assert step.wire_bytes == wire
    assert step.layout_before == lay(tp=src).without_replicate()
    assert step.layout_after == lay(tp=dst).without_replicate()
    assert step.backward == conjugate(kind)


def test_partial_of_another_reduction_is_an_error() -> None:
    with pytest.raises(ShardcError, match="partial values of different reductions"):
        redistribute(lay(tp=P), lay(tp=Partial("max")), T, MESH)


def test_shard_of_a_missing_dim_is_an_error() -> None:
    with pytest.raises(ShardcError, match="shards dim 2"):
        redistribute(lay(tp=Shard(2)), lay(), T, MESH)


def steps_text(src: Layout, dst: Layout) -> list[str]:
    return [f"{s.kind}[{s.axis}] {s.bytes_in_per_device}->{s.bytes_out_per_device}"
            for s in redistribute(src, dst, T, MESH)]


def test_reduce_before_gathering_and_slice_before_reducing() -> None:
    assert steps_text(lay(dp=Shard(0), tp=P), lay()) == ["all_reduce[tp] 192->192", "all_gather[dp] 192->384"]
    assert steps_text(lay(tp=P), lay(dp=Shard(0))) == ["chunk[dp] 384->192", "all_reduce[tp] 192->192"]
    assert steps_text(lay(dp=Shard(0), tp=P), lay(dp=Shard(1), tp=Shard(0))) == [
        "all_to_all[dp] 192->192", "reduce_scatter[tp] 192->48"]


def test_nested_shards_of_one_dim_keep_mesh_order() -> None:
    # Outer axis first when slicing, inner axis first when gathering.
    assert steps_text(lay(), lay(dp=Shard(0), tp=Shard(0))) == ["chunk[dp] 384->192", "chunk[tp] 192->48"]
    assert steps_text(lay(dp=Shard(0), tp=Shard(0)), lay()) == ["all_gather[tp] 48->192", "all_gather[dp] 192->384"]
    # An inner shard in the way is gathered and sliced again.
    assert steps_text(lay(tp=Shard(0)), lay(dp=Shard(0), tp=Shard(0))) == [
        "all_gather[tp] 96->384", "chunk[dp] 384->192", "chunk[tp] 192->48"]


def test_steps_chain_from_src_to_dst() -> None:
    src, dst = lay(dp=Shard(1), tp=P), lay(dp=Shard(0), tp=Shard(1))
    steps = redistribute(src, dst, T, MESH)
    assert steps[0].layout_before == src and steps[-1].layout_after == dst
    assert all(a.layout_after == b.layout_before for a, b in zip(steps, steps[1:]))


def test_axes_of_size_one_need_no_step() -> None:
    mesh = Mesh((("pp", 1), ("dp", 1), ("tp", 2)))
    src = Layout((("dp", Shard(0)), ("tp", Partial("sum"))))
    assert [s.kind for s in redistribute(src, Layout(), T, mesh)] == ["all_reduce"]


def test_conjugates() -> None:
    assert conjugate("all_gather") == "reduce_scatter" and conjugate("reduce_scatter") == "all_gather"
    assert conjugate("all_reduce") == "identity" and conjugate("identity") == "all_reduce"
    assert conjugate("rotate") == "rotate_reverse" and conjugate("rotate_reverse") == "rotate"
    assert conjugate("chunk") == "all_gather" and conjugate("send_recv") == "send_recv"
    assert conjugate("all_to_all") == "all_to_all"
    # The gradient of a replicated value decides: partial (data axes, Megatron's f) or replicated.
    assert conjugate("all_gather", partial_grad=False) == "chunk"
    assert conjugate("all_reduce", partial_grad=True) == "all_reduce"
    assert conjugate("chunk", partial_grad=True) == "pad"
    with pytest.raises(ValueError, match="unknown reshard kind"):
        conjugate("broadcast")


def test_backward_steps_swap_bytes_and_layouts() -> None:
    (gather,) = redistribute(lay(tp=Shard(1)), lay(), T, MESH)
    back = backward_step(gather, MESH)
    assert back is not None
    assert (back.kind, back.bytes_in_per_device, back.bytes_out_per_device) == ("reduce_scatter", 384, 96)
    assert back.layout_before == lay(tp=P) and back.layout_after == lay(tp=Shard(1))
    assert back.wire_bytes == gather.wire_bytes
    (reduce,) = redistribute(lay(tp=P), lay(), T, MESH)
    assert backward_step(reduce, MESH) is None  # all_reduce forward, identity backward
    marker = ReshardStep("identity", "tp", lay(), lay(), 384, 384, 4, "all_reduce")
    back = backward_step(marker, MESH)
    assert back is not None and (back.kind, back.layout_before, back.layout_after) == ("all_reduce", lay(tp=P), lay())


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown reshard kind"):
        ReshardStep("broadcast", "tp", lay(), lay(), 1, 1, 2)
