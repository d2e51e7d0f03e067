"""The memory at the peak: identity dropout, the backward timeline, DDP/FSDP2/pipeline buffers, and
`shardc estimate` tracing at the plan's batch."""

from __future__ import annotations

import pytest
import torch
from traced import gpt_graph

from shardc.calibration.profile import AlphaBeta, CollectiveFit, LocalProfile, at_speed
from shardc.cost import CostContext, estimate, layer_costs
from shardc.cost.compose import EstimateOptions
from shardc.hardware import local_cluster, parse_cluster
from shardc.plan.parallel import ParallelPlan

B, S, H, A, V = 4, 64, 128, 4, 512


def _graph(dropout: float = 0.0, **kw):
    return gpt_graph(layers=2, hidden=H, heads=A, vocab=V, seq=S, batch=B * kw.get("dp", 1), dropout=dropout,
                     dtype="f32", **kw)


def test_identity_dropout_saves_nothing_and_aliases() -> None:
    # fp32, p=0: LN1 in, qkv in, q/k/v (3), proj in, LN2 in, fc1 in, gelu in (4), fc2 in (4) = 16 sbh,
    # the softmax output (a s^2 b), and two LayerNorms' mean and rstd (2 fp32 per row each).
    g = _graph(0.0)
    ctx = CostContext.build(g, parse_cluster("1xH100"), "f32", 1.0)
    saved = layer_costs(ctx, g.layer_nodes("blocks.0")).saved_bytes
    assert saved == 4 * (16 * S * B * H + A * S * S * B) + 2 * 2 * 4 * B * S
    with_masks = layer_costs(CostContext.build(_graph(0.1), parse_cluster("1xH100"), "f32", 1.0),
                             _graph(0.1).layer_nodes("blocks.0")).saved_bytes
    assert with_masks > saved  # masks, and the dropped-out probabilities are a storage of their own


def test_peak_adds_the_backward_working_set_to_saved_activations() -> None:
    g = _graph(0.0)
    e = estimate(g, parse_cluster("1xH100"), ParallelPlan.parse(f"mb={B},dtype=fp32"))
    mem = e.stages[0].memory
    saved = sum(r["saved_bytes"] for r in e.layer_table)
    # The peak is the loss's backward: every activation still saved, plus the gradients of the
    # log-probabilities and of the logits (each the size of the logits).
    assert mem["activations"] == pytest.approx(saved)
    assert mem["working"] == pytest.approx(2 * 4 * B * S * V, rel=0.01)


def test_ddp_buckets_hold_one_copy_of_the_gradients_whatever_their_size() -> None:
    cluster = parse_cluster("2xH100")
    plan = ParallelPlan.parse(f"dp=2,mb={B},dtype=fp32")
    sizes = [estimate(_graph(0.0, dp=2), cluster, plan, options=EstimateOptions(bucket_bytes=b)).stages[0].memory
             for b in (10e3, 25 * 2**20)]
    assert sizes[0]["buffers"] == sizes[1]["buffers"] == pytest.approx(sizes[0]["gradients"])


def test_fsdp2_shards_every_state_and_gathers_the_whole_module() -> None:
    cluster = parse_cluster("2xH100")
    base = estimate(_graph(0.0, dp=2), cluster, ParallelPlan.parse(f"dp=2,mb={B},dtype=fp32")).stages[0].memory
    for zero in (1, 3):
        plan = ParallelPlan.parse(f"dp=2,mb={B},dtype=fp32,zero={zero}")
        fsdp = estimate(_graph(0.0, dp=2, zero=zero), cluster, plan).stages[0].memory
        textbook = estimate(_graph(0.0, dp=2, zero=zero), cluster, plan,
                            options=EstimateOptions(zero_runtime="zero")).stages[0].memory
        for key in ("parameters", "gradients", "optimizer"):
            assert fsdp[key] == pytest.approx(base[key] / 2)
        # unsharded parameters and the flat all-gather buffer they are copied out of
        assert fsdp["buffers"] == pytest.approx(2 * base["parameters"])
        assert textbook["parameters"] == pytest.approx(base["parameters"] / (2 if zero >= 3 else 1))


def test_torch_pipeline_keeps_receive_buffers_and_last_stage_outputs() -> None:
    cluster = parse_cluster("2xH100")
    plan = ParallelPlan.parse("pp=2,mb=2,gbs=8,dtype=fp32")
    g = gpt_graph(layers=2, hidden=H, heads=A, vocab=V, seq=S, batch=8, dropout=0.0, dtype="f32", pp=2)
    torch_rt = estimate(g, cluster, plan)
    none = estimate(g, cluster, plan, options=EstimateOptions(pipeline_runtime="none"))
    m, act = 4, 4 * 2 * S * H
    # the first stage: a gradient-receive buffer per micro-batch, the 2 outputs in flight, and one
    # more output that Schedule1F1B's warm-up send work holds (measured: 7 x 64 KiB on the README
    # study's pp=2,mb=2 plan)
    assert torch_rt.stages[0].memory["buffers"] - none.stages[0].memory["buffers"] == pytest.approx((m + 3) * act)
    # the last stage: a receive buffer per micro-batch, the previous backward's input gradient held
    # by the pending send while the next backward runs, and one micro-batch's output (the schedule
    # is stepped with return_outputs=False, so no output is kept past its backward; GPipe runs
    # every forward before the first backward, so it holds all m)
    out = 4 * 2 * S * V
    assert torch_rt.stages[1].memory["buffers"] - none.stages[1].memory["buffers"] == pytest.approx(
        (m + 1) * act + out)
    gpipe = ParallelPlan.parse("pp=2,mb=2,gbs=8,dtype=fp32,schedule=gpipe")
    gpipe_extra = (estimate(g, cluster, gpipe).stages[1].memory["buffers"]
                   - estimate(g, cluster, gpipe, options=EstimateOptions(pipeline_runtime="none")).stages[1].memory["buffers"])
    assert gpipe_extra == pytest.approx((m + 1) * act + m * out)


def test_estimate_traces_a_factory_at_the_plans_batch(tmp_path) -> None:
    from shardc.driver import estimate as estimate_spec
    from shardc.driver import partition

    cluster = parse_cluster("8xH100")
    plan = ParallelPlan.parse("dp=8,mb=1")
    graph, _ = partition("examples/gpt.py:tiny", cluster, plan)
    assert graph.inputs[0].type.shape[0] == 8
    # A batch pinned in the spec does not limit the plan either: the driver traces at dp*mb.
    pinned, _ = partition("examples/gpt.py:tiny?batch=1", cluster, plan)
    assert pinned.inputs[0].type.shape[0] == 8
    assert estimate_spec("examples/gpt.py:tiny?batch=1", cluster, plan)[0].to_json() == \
        estimate_spec("examples/gpt.py:tiny?batch=8", cluster, plan)[0].to_json()


def _profile() -> LocalProfile:
    fit = AlphaBeta(1e-4, 1e-9)
    return LocalProfile(1, "now", "cpu", 2, 8 << 30, torch.__version__, True, ((256, 50e9),), 50e9, 1e5,
                        (("bf16", 0.5), ("fp16", 0.5)), 5e9, 3e-6, ((2, 40e9, 4e9),),
                        (CollectiveFit("all_reduce", 2, ((1024, 1e-4), (1 << 20, 1e-3)), fit),))


def test_at_speed_slows_everything_a_process_does_alike() -> None:
    prof = _profile()
    slow, fast = local_cluster(2, at_speed(prof, 2.0)), local_cluster(2, prof)
    assert slow.device.memory_bandwidth == pytest.approx(fast.device.memory_bandwidth / 2)
    assert slow.device.kernel_latency == pytest.approx(fast.device.kernel_latency * 2)
    assert slow.device.peak("fp32") == pytest.approx(fast.device.peak("fp32") / 2)
    assert slow.intra.latency == pytest.approx(fast.intra.latency * 2)
    assert slow.intra.bandwidth == pytest.approx(fast.intra.bandwidth / 2)
    assert at_speed(prof, 1.0) == prof
    with pytest.raises(ValueError, match="positive"):
        at_speed(prof, 0.0)


def test_the_optimizer_step_is_a_peak_of_its_own() -> None:
    # A large vocabulary at a tiny batch over two stages (each holds its own copy of the tied
    # embedding and head): the torch backend's AdamW(foreach=False) step, which holds two fp32
    # copies of the parameter it updates (its second moment's square root and that over the bias
    # correction), is each stage's peak: the embedding, twice, where backward made one gradient of
    # it at a time. (Measured on plan_quality's gpt-vocab grid plan, first stage: 7.07 MB, predicted
    # 6.58 before this candidate and 7.14 after.) Fused Adam (Megatron's runtime) makes none.
    vocab = 16384
    g = gpt_graph(layers=2, hidden=H, heads=A, vocab=vocab, seq=8, batch=2, dropout=0.0, dtype="f32", pp=2)
    cluster = parse_cluster("2xH100")
    plan = ParallelPlan.parse("pp=2,mb=1,gbs=2,dtype=fp32")
    largest = max(p.type.numel for p in g.params)
    assert largest == vocab * H
    for torch_rt, fused in zip(estimate(g, cluster, plan).stages,
                               estimate(g, cluster, plan, options=EstimateOptions(pipeline_runtime="none")).stages):
        assert torch_rt.memory["activations"] == 0.0 and torch_rt.memory["working"] == pytest.approx(2 * 4 * largest)
        assert fused.memory["activations"] > 0.0 and fused.memory["working"] < 4 * largest * 1.1
