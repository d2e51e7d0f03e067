"""The solver searches expert parallelism: mesh shapes with an `ep` axis for MoE models, the
`experts` op's candidates splitting its experts (or its tokens) over ep, and a plan that picks ep
where the experts' weights dominate memory; the plan file it writes trains like one process."""

from __future__ import annotations

import json

import pytest
from test_moe import transformers_losses

from shardc.search.outer import mesh_shapes, micro_batch_sizes

# Experts dominate: 8 experts of intermediate 256 per layer (393k parameters) beside 16k of attention.
_ATTN = "hidden_size=64&num_attention_heads=4&vocab_size=128&seq=16&batch=8"
MIXTRAL_WIDE = (f"hf:mixtral?{_ATTN}&intermediate_size=256&num_hidden_layers=2&num_key_value_heads=2"
                "&num_local_experts=8")
GBS = 8
# Per device, predicted on the fixed `local` profile (fp32, Adam): dp=4 18.7 MiB, dp=4 under ZeRO-3
# 13.1 MiB (FSDP2 gathers the whole model), dp=2 x pp=2 10.8 MiB, dp=2 x ep=2 10.0 MiB; ep=4 4.7 MiB.
LIMIT_GB = 6 / 1024


def test_mesh_shapes_offer_ep_only_for_models_with_experts() -> None:
    shapes = mesh_shapes(4, 4, 2, GBS, 16, experts=8)
    assert {s.ep for s in shapes} == {1, 2, 4} and all(s.devices == 4 for s in shapes)
    from shardc.search.schedules import schedule_shapes

    # pipelines with ep: every schedule (`test_moe_offers` checks each trains), no tp x tq grid
    four = mesh_shapes(4, 4, 4, GBS, 16, grid2d=True, experts=8)
    assert {s.vpp for s in four if s.ep > 1 and s.pp > 1} == {1, 2}
    eight = mesh_shapes(8, 8, 4, GBS, 16, grid2d=True, experts=8)
    assert {s.ep for s in eight if s.tq > 1} == {1} and any(s.ep > 1 and s.tp == 4 for s in eight)
    zero_bubble = schedule_shapes(four, 4, 4)
    assert {s.schedule for s in zero_bubble if s.ep > 1} == {"zbv", "dualpipev", "interleaved-zb"}
    assert {s.ep for s in mesh_shapes(4, 4, 2, GBS, 16)} == {1}
    assert {s.ep for s in mesh_shapes(4, 4, 2, GBS, 16, experts=6)} == {1, 2}  # ep divides the experts
    assert micro_batch_sizes(GBS, 1, 1, 4) == [4, 8]  # ep splits each micro-batch: 1 or 2 sequences per rank
    assert micro_batch_sizes(GBS, 2, 2, 2) == [2]


def test_experts_candidates_split_experts_or_tokens_over_ep_and_dense_ops_the_batch() -> None:
    from shardc.driver import load, solver_batch
    from shardc.hardware import parse_cluster
    from shardc.search.problem import MeshShape, build_problem, graph_facts

    cluster = parse_cluster("4xH100")
    facts = graph_facts(load(MIXTRAL_WIDE, batch=solver_batch(GBS)), cluster, "fp32")
    problem = build_problem(facts, cluster, MeshShape(1, 1, 1, 1, ep=4), 4, GBS, "fp32")
    experts = [v for v in problem.groups if v.group.anchor.op == "experts"]
    assert experts
    splits = {dict(c.partitions[0].spatial).get("ep") for c in experts[0].cands}
    assert splits == {"e", "t"}
    for var in problem.groups:
        if var.group.anchor.op == "experts" or var.cands[0].partitions[0] is None:
            continue
        for cand in var.cands:  # ep is a data axis outside the experts: the batch or nothing
            dims = [d for a, d in cand.partitions[0].spatial if a == "ep"]
            assert all(var.group.spaces[0] is not None and d not in var.group.spaces[0].unsplittable for d in dims)


def test_solver_picks_ep_where_expert_weights_dominate_memory_and_its_plan_trains_like_one_process(
        tmp_path, monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    """On 4 local processes under a memory limit that data parallelism (with or without ZeRO) and a
    two-stage pipeline exceed, the solver splits the experts over ep; `shardc run --plan FILE`
    then trains as transformers does in one process."""
    from test_hardware import _profile

    from shardc.calibration.profile import write_profile
    from shardc.cli import main
    from shardc.plan.file import PlanFile

    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))  # a fixed profile of `local`: never calibrated here
    write_profile(_profile(), tmp_path / "local-profile.json")
    path = tmp_path / "moe.plan"
    assert main(["plan", MIXTRAL_WIDE, "--cluster", "local4", "--gbs", str(GBS), "--time-limit", "1",
                 "--dtype", "fp32", "--memory-limit", str(LIMIT_GB), "-o", str(path), "--json"]) == 0
    capsys.readouterr()
    import shardc

    for plan in ("dp=4,zero=3,mb=1", "dp=2,pp=2,mb=1"):  # what the limit rules out (dp=4 holds more)
        est = shardc.compile(MIXTRAL_WIDE, plan=f"{plan},gbs={GBS},dtype=fp32", cluster="local4", device="meta")
        assert est.estimate().memory_per_device_bytes > LIMIT_GB * 2**30, plan
    file = PlanFile.load(path)
    assert file.plan.ep > 1, file.plan
    experts = [g.partition for g in file.groups if (g.anchor or "").startswith("experts@")]
    assert experts and all(p == "partition<ep:e>" for p in experts), experts  # the experts split over ep
    assert main(["run", MIXTRAL_WIDE, "--nproc", "4", "--steps", "2", "--plan", str(path), "--seed", "3",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["losses"]
    assert got == pytest.approx(transformers_losses(MIXTRAL_WIDE, 2, 3), rel=1e-5)

