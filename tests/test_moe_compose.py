"""Expert parallelism composed with the rest: expert tensor parallelism (tp splitting every expert's
intermediate dim, the dense layers under ordinary tp), ZeRO (FSDP2) and full recomputation.

Numerics as in `test_moe`: 3 AdamW steps of a small transformers MoE model on 2 or 4 gloo
processes, losses and every weight against the model trained by transformers itself in one
process, at 1e-5 (fp32). ep x pp trains in `test_moe.test_expert_parallel_pipelined_...`.
"""

from __future__ import annotations

import pytest
from shared_spawn import SharedRuns, spawn_jobs
from test_backend_numerics import check_cases, compile_cases, run_and_check, run_cases
from test_moe import MIXTRAL, QWEN3_MOE
from test_pipeline_numerics import check_cases as check_pipelines
from test_pipeline_numerics import compile_cases as compile_pipelines
from test_pipeline_numerics import step_cases


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


FOUR_PROCESSES = [(QWEN3_MOE, "ep=2,tp=2,sp=1,mb=4", ""), (MIXTRAL, "dp=2,ep=2,zero=1,mb=2", ""),
                  (MIXTRAL, "dp=2,ep=2,zero=3,recompute=full,mb=2", "")]
FOUR_PROCESSES_PIPELINED = [(MIXTRAL.replace("num_hidden_layers=1", "num_hidden_layers=4"),
                             "ep=2,pp=2,vpp=2,schedule=zbv,mb=2")]


@pytest.fixture(scope="module")
def on_four_processes() -> SharedRuns:
    """Both four-process tests' plans trained in one spawned group (`tests/shared_spawn.py`)."""
    return spawn_jobs(4, [lambda: (run_cases, (compile_cases(FOUR_PROCESSES),)),
                          lambda: (step_cases, (compile_pipelines(FOUR_PROCESSES_PIPELINED),))], timeout_s=600)


def test_expert_parallel_with_sp_zero_and_recompute_matches_one_process_on_4_processes(
        on_four_processes: SharedRuns) -> None:
    """ep x tp with sequence parallelism (the experts' tokens all-gathered over tp, their partial
    output reduce-scattered); dp x ep under ZeRO-1 and ZeRO-3 (FSDP2 over dp: the dense layers'
    gradients summed over ep first, the experts' only over dp), ZeRO-3 with full recomputation."""
    assert check_cases(FOUR_PROCESSES, on_four_processes[0][0]) == []


def test_expert_parallel_under_the_zero_bubble_v_schedule_matches_one_process_on_4_processes(
        on_four_processes: SharedRuns) -> None:
    """ep x pp under torch's zbv (two virtual stages per rank, the backward split into input and
    weight gradients: the all-to-alls' gradients run in the input pass): the one zero-bubble
    schedule the solver offers with ep (`shardc.search.schedules`)."""
    check_pipelines(FOUR_PROCESSES_PIPELINED, on_four_processes[1][0])
