"""Codegen and API without process groups: generated code, local shards, files, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardc
from shardc.backends.torch import collectives as C
from shardc.backends.torch.codegen import local_piece
from shardc.backends.torch.parallelize import check_model, local_tensors
from shardc.frontend.spec import load_model
from shardc.ir import Layout, Mesh, Shard
from shardc.ir.diagnostics import ShardcError

GPT = "examples/gpt.py:tiny?batch=4"


@pytest.fixture(scope="module")
def tp_plan() -> shardc.CompiledPlan:
    return shardc.compile(GPT, plan="dp=2,tp=2")


def test_code_is_readable_and_rank_specific(tp_plan: shardc.CompiledPlan) -> None:
    code0, code1 = tp_plan.code(0), tp_plan.code(1)
    assert code0.startswith("# rank 0 of mesh<pp=1, dp=2, cp=1, tp=2> (pp=0, dp=0, cp=0, tp=0)")
    assert "# ---- blocks.0: Layer_blocks_0 ----" in code0
    # Megatron's collectives, named like the IR values they produce
    assert "x25_all_reduce = shardc_backends_torch_collectives_all_reduce(x25, mesh, 'tp', op = 'sum'" in code0
    assert "grad_all_reduce(x28, mesh, 'tp')" in code0
    # vocab-parallel loss: each rank's slice of the vocabulary is a literal of its own code
    # (the plan's default bf16: the loss reads its logits in fp32, `backends/torch/precision.py`)
    assert "x65_f32 = x65.to(torch.float32)" in code0
    assert "vocab_parallel_cross_entropy(x65_f32, x66, mesh, axis = 'tp', vocab_start = 0)" in code0
    assert "vocab_parallel_cross_entropy(x65_f32, x66, mesh, axis = 'tp', vocab_start = 64)" in code1
    assert "local_input(idx, mesh, name = 'idx', shape = (4, 16), shards = (('dp', 0, 1),))" in code0


def test_module_holds_only_local_shards_under_model_names(tp_plan: shardc.CompiledPlan) -> None:
    module = tp_plan.module(3)
    state = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    assert state["wte.weight"] == (64, 64)                      # vocab-parallel rows
    assert state["blocks.0.attn.qkv.weight"] == (96, 64)        # q, k and v heads, strided
    assert state["blocks.0.mlp.fc2.weight"] == (64, 128)        # row parallel
    assert state["blocks.0.ln1.weight"] == (64,)                # replicated
    assert isinstance(module.get_submodule("blocks.0"), torch.fx.GraphModule)


def test_local_tensors_cut_full_tensors_and_meta_models_materialise(tp_plan: shardc.CompiledPlan) -> None:
    torch.manual_seed(0)
    model = load_model(GPT).model
    pieces = local_tensors(tp_plan.graph, model, rank=3)
    full = model.blocks[0].attn.qkv.weight.detach()
    want = torch.cat([full[32:64], full[96:128], full[160:192]])  # rank 3 is tp=1: its half of q, k, v
    assert torch.equal(pieces["blocks.0.attn.qkv.weight"], want)

    meta = load_model(GPT, device="meta").model
    filled = local_tensors(tp_plan.graph, meta, rank=1, init=lambda name, t: t.fill_(len(name)), seed=7)
    assert torch.equal(filled["wte.weight"], torch.full((64, 64), float(len("wte.weight"))))
    with pytest.raises(ShardcError, match="wte.weight is on the meta device"):
        local_tensors(tp_plan.graph, meta, rank=0)


def test_strided_pieces_round_trip() -> None:
    x = torch.arange(24.0).reshape(2, 12)
    mesh = Mesh((("tp", 2),))
    parts = [local_piece(x, Layout((("tp", Shard(1, 3)),)), mesh, {"tp": c}) for c in range(2)]
    assert parts[0].tolist()[0] == [0, 1, 4, 5, 8, 9]
    assert torch.equal(C._assemble(parts, 1, 3), x)


def test_plan_that_does_not_match_the_model(tp_plan: shardc.CompiledPlan) -> None:
    other = load_model("examples/gpt.py:tiny?batch=4&n_embd=32&n_head=2", device="meta").model
    with pytest.raises(ShardcError, match=r"does not match this model: shapes differ: wte.weight: plan \(128, 64\)"):
        check_model(tp_plan.graph, other)
    llama = load_model("examples/llama.py:tiny", device="meta").model
    with pytest.raises(ShardcError, match="missing in the model: wte.weight, wpe.weight"):
        check_model(tp_plan.graph, llama)


def test_inputs_of_other_shapes_are_refused(tp_plan: shardc.CompiledPlan) -> None:
    module = tp_plan.module(0)
    with pytest.raises(ShardcError, match=r"input idx has shape \(4, 8\), but the plan was compiled for \(4, 16\)"):
        module(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))


def test_compile_to_dir_writes_ir_and_code_atomically(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    shardc.compile_to_dir(GPT, "tp=2", out)
    assert sorted(p.name for p in out.iterdir()) == ["graph.ir", "plan.txt", "rank0.py", "rank1.py"]
    assert (out / "graph.ir").read_text().startswith("graph @gpt_tiny mesh<pp=1, dp=1, cp=1, tp=2>")
    shardc.compile_to_dir(GPT, "dp=2", out)  # replaces the old directory as a whole
    assert "dp=2" in (out / "plan.txt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]  # no temporary left behind


def test_errors_for_ranks_and_pipelines(tp_plan: shardc.CompiledPlan) -> None:
    with pytest.raises(ShardcError, match="rank 4 is outside the plan's mesh"):
        tp_plan.code(4)
    piped = shardc.compile(GPT, plan="pp=2")  # pipelines parallelize too, inside a process group
    code1 = piped.code(1)  # pipeline rank 1: the last stage, then the IR's loss as the schedule's loss_fn
    assert "# ==== stage 1 of 2 ====" in code1 and "def forward(self, x33_send_recv):" in code1
    assert "# ==== loss (the schedule's loss_fn on the last stage) ====" in code1
    assert "shape = (1, 16, 4, 16)" in code1  # one micro-batch of 1 sequence (4 micro-batches)
    assert "# ==== stage 0 of 2 ====" in piped.code(0) and "loss" not in piped.code(0).split("====")[-1][:40]
    with pytest.raises(ShardcError, match="torch.distributed is not initialised"):
        piped.parallelize(torch.nn.Linear(1, 1))
