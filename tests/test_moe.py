"""Mixture-of-Experts: transformers' expert blocks as one `experts` op, and expert parallelism.

Numerics as in `test_backend_numerics`: 3 AdamW steps of a small transformers MoE model (hidden
64, 4 experts, top-2) on 2 gloo processes under ep=2, compared with the model trained by
transformers itself in one process, at 1e-5 (fp32); ep x dp, ep x tp and ep x pp on 4 processes
train in `test_moe_matrix` (issue 15's matrix, one launch per path).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_backend_numerics import build, run_and_check

_ATTN = "hidden_size=64&num_attention_heads=4&vocab_size=128&seq=16&batch=4"
MIXTRAL = f"hf:mixtral?{_ATTN}&intermediate_size=128&num_hidden_layers=1&num_key_value_heads=2&num_local_experts=4"
QWEN3_MOE = (f"hf:qwen3_moe?{_ATTN}&intermediate_size=128&moe_intermediate_size=32&num_hidden_layers=1"
             "&num_key_value_heads=2&num_experts=4&num_experts_per_tok=2")
DEEPSEEK_V3 = (f"hf:deepseek_v3?{_ATTN}&intermediate_size=128&moe_intermediate_size=32&num_hidden_layers=2"
               "&first_k_dense_replace=1&num_key_value_heads=4&n_routed_experts=4&num_experts_per_tok=2&n_group=1"
               "&topk_group=1&kv_lora_rank=16&q_lora_rank=32&qk_rope_head_dim=8&qk_nope_head_dim=8&v_head_dim=16")


def _graph(spec: str) -> object:
    from shardc.frontend import trace_with_state

    model, inputs, names = build(spec)
    return trace_with_state(model, inputs, input_names=names)


def test_expert_blocks_are_one_op_that_computes_what_transformers_computes() -> None:
    from shardc.backends.reference import model_state, run_graph

    for spec, blocks in ((MIXTRAL, 1), (QWEN3_MOE, 1), (DEEPSEEK_V3, 1)):
        traced = _graph(spec)
        graph = traced.graph  # type: ignore[attr-defined]
        experts = [n for n in graph.nodes if n.op == "experts"]
        assert len(experts) == blocks, spec
        assert experts[0].location.module_path.endswith("mlp.experts")
        assert not any("grouped_mm" in str(n.attrs.get("target", "")) for n in graph.nodes), spec
        model, inputs, _ = build(spec)
        want = model(*inputs)
        got = run_graph(graph, inputs, model_state(model, graph, traced.constants))[0]  # type: ignore[attr-defined]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_expert_parallel_training_matches_one_process_on_2_processes() -> None:
    """ep=2 alone for the three models (DeepSeek-V3: MLA attention, a dense first layer, shared
    experts); their 4-process compositions train in `test_moe_matrix`."""
    assert run_and_check(2, [(MIXTRAL, "ep=2,mb=4", ""), (QWEN3_MOE, "ep=2,mb=4", ""),
                             (DEEPSEEK_V3, "ep=2,mb=4", "")]) == []


def test_shardc_run_trains_mixtral_expert_parallel_like_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    """`shardc run` on the transformers model itself (its logits, next-token loss): ep=2 on two
    processes, losses as one process computes them with the same data."""
    from shardc.cli import main

    steps, seed = 2, 3
    assert main(["run", MIXTRAL, "--nproc", "2", "--steps", str(steps), "--plan", "ep=2,mb=4,dtype=fp32",
                 "--seed", str(seed), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["losses"]
    want = transformers_losses(MIXTRAL, steps, seed)
    assert got == pytest.approx(want, rel=1e-5)


def test_expert_parallel_cost_all_to_all_per_link_level_skew_and_expert_memory() -> None:
    """The all-to-alls of ep=2 cost more across nodes than inside one; routing skew charges the
    experts' compute and exchange more; expert parameters and optimizer states are halved by
    ep=2 against dp=2 (fp32: 4 bytes a parameter, Adam 8), and the estimate's memory table says
    how much of the states are the experts'."""
    import shardc

    def estimate(plan: str, cluster: str, skew: float | None = None) -> object:
        return shardc.compile(MIXTRAL, plan=f"{plan},dtype=fp32", cluster=cluster, device="meta").estimate(
            routing_skew=skew)

    inside = estimate("ep=2,mb=4", "2xH100").stages[0]  # type: ignore[attr-defined]
    across = estimate("ep=2,mb=4", "2x1xH100").stages[0]  # type: ignore[attr-defined]
    assert across.time["ep_comm"] > inside.time["ep_comm"] > 0
    skewed = estimate("ep=2,mb=4", "2xH100", 2.0).stages[0]  # type: ignore[attr-defined]
    assert skewed.time["compute_fwd"] > inside.time["compute_fwd"]
    assert skewed.time["ep_comm"] > inside.time["ep_comm"]
    data = estimate("dp=2,mb=2", "2xH100").stages[0]  # type: ignore[attr-defined]
    experts = 4 * (256 * 64 + 64 * 128)  # gate_up_proj + down_proj elements
    assert data.memory["parameters"] - inside.memory["parameters"] == 4 * experts / 2
    assert data.memory["optimizer"] - inside.memory["optimizer"] == 8 * experts / 2
    # The breakdown names the expert weights' states (weights, fp32 gradients, Adam: 16 bytes each)
    assert data.expert_state_bytes == 16 * experts  # type: ignore[attr-defined]
    assert inside.expert_state_bytes == 16 * experts / 2  # type: ignore[attr-defined]
    from rich.console import Console

    from shardc.cost.report import tables

    console = Console(record=True, width=200)
    for table in tables(estimate("ep=2,mb=4", "2xH100")):  # type: ignore[arg-type]
        console.print(table)
    text = console.export_text()
    row = next(line for line in text.splitlines() if "of which expert states" in line)
    assert "768 KiB" in row and "ep_comm" in text


def test_plans_ep_cannot_take_are_refused_naming_the_constraint() -> None:
    import shardc
    from shardc.ir.diagnostics import ShardcError

    with pytest.raises(ShardcError, match=r"ep=2 splits each micro-batch of mb=1 sequences.*use mb a multiple of 2"):
        shardc.compile(MIXTRAL, plan="ep=2,mb=1", device="meta")
    with pytest.raises(ShardcError, match=r"mesh axis ep=3 does not divide iteration dim e \(size 4\) of experts"):
        shardc.compile(MIXTRAL, plan="ep=3,mb=3", device="meta")
    from shardc.plan.parallel import ParallelPlan

    plan = ParallelPlan.parse("dp=2,ep=2,mb=2")
    assert str(ParallelPlan.parse(str(plan))) == str(plan) and str(plan).endswith(",ep=2")
    assert plan.devices == 4 and [a for a, _ in plan.mesh().axes] == ["pp", "dp", "ep", "cp", "tp"]
    assert "ep" not in str(ParallelPlan.parse("dp=2")) and "ep" not in ParallelPlan.parse("dp=2").mesh().names


def transformers_losses(spec: str, steps: int, seed: int) -> list[float]:
    """transformers' model in one process: its logits, the next-token loss, AdamW, the data `shardc run` draws."""
    import torch.nn.functional as F

    import shardc
    from shardc.frontend.spec import load_model
    from shardc.train import input_ranges, synthetic_batch, vocab_of

    torch.manual_seed(seed)
    loaded = load_model(spec, device="cpu")
    model, example = loaded.model, list(loaded.example_inputs)
    ranges = input_ranges(shardc.compile(spec, plan="dp=1", device="meta").graph, loaded.input_names,
                          vocab_of(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(steps):
        batch = synthetic_batch(example, ranges, seed, step)
        logits = model(*batch).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[0].roll(-1, dims=-1).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out
