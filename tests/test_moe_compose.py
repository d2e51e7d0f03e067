"""Expert parallelism composed with the rest: expert tensor parallelism (tp splitting every expert's
intermediate dim, the dense layers under ordinary tp), ZeRO (FSDP2) and full recomputation.

Numerics as in `test_moe`: 3 AdamW steps of a small transformers MoE model on 2 or 4 gloo
processes, losses and every weight against the model trained by transformers itself in one
process, at 1e-5 (fp32). The 4-process compositions (ep x tp with sp, dp x ep under ZeRO-1/2/3 with
recomputation, ep x pp under every schedule) train in `test_moe_matrix`'s one 4-process launch.
"""

from __future__ import annotations

from test_backend_numerics import run_and_check
from test_moe import MIXTRAL


def _experts_node(plan: str) -> object:
    import shardc

    graph = shardc.compile(MIXTRAL, plan=plan, device="meta").graph
    return next(n for n in graph.nodes if n.op == "experts")


def test_tp_splits_each_experts_intermediate_dim_gate_and_up_alike() -> None:
    """apply-plan: tp splits the experts' `i` (gate/up rows as two strided pieces, down's columns),
    the output Partial(sum) over tp; ep splits the experts themselves."""
    from shardc.ir import Partial, Shard

    node = _experts_node("ep=2,tp=2,mb=4")
    assert dict(node.partition.spatial) == {"ep": "e", "tp": "i"}  # type: ignore[attr-defined]
    gate_up, down = node.inputs[3].layout, node.inputs[4].layout  # type: ignore[attr-defined]
    assert gate_up.on("ep") == Shard(0) and gate_up.on("tp") == Shard(1, 2)
    assert down.on("ep") == Shard(0) and down.on("tp") == Shard(2)
    assert isinstance(node.outputs[0].layout.on("tp"), Partial)  # type: ignore[attr-defined]


def test_expert_tensor_parallel_and_recomputed_expert_parallel_match_one_process_on_2_processes() -> None:
    """tp=2 alone (the experts' intermediate dim split, attention heads split, router column-parallel);
    ep=2 with every block recomputed in backward (the dispatch and combine all-to-alls run again)."""
    assert run_and_check(2, [(MIXTRAL, "tp=2,mb=4", ""), (MIXTRAL, "ep=2,recompute=full,mb=4", "")]) == []
