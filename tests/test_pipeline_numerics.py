"""Pipelined plans built from the IR (per-stage codegen) and micro-batching, on real gloo groups.

Every case compiles a plan with `shardc.compile`, builds each rank's stage modules with
`plan.parallelize(model)` and trains 3 AdamW steps with `module.step(*batch)` (the plan's
schedule over its micro-batches, the loss from the IR's own cross entropy). The loss at every
step and every parameter afterwards must equal one process training on the whole batch (the
helpers of test_backend_numerics), within 1e-5 relative. Tiny models: GPT and Llama examples
and transformers' GPT2LMHeadModel (4 layers where the plan interleaves 4 virtual stages).
Data parallelism inside a pipeline runs through torch's wrappers of each stage module (DDP,
FSDP2 for ZeRO-1/2/3), which the cases check too; a case may deal the blocks to stages
unevenly (`split`, as the study's `split=3+1`) before lowering.
"""

from __future__ import annotations

import torch
from test_backend_numerics import EPS, GPT, HF_GPT2, LLAMA, LR, batches, build, check

from shardc.backends.torch.launch import spawn
from shardc.study.predict import stage_split

FOUR_LAYERS = "&n_layer=4"


def step_cases(rank: int, world: int, cases: list[tuple[str, object]]) -> list[tuple[list[float], dict, list[str]]]:
    """On every rank: parallelize each compiled plan and train it with `module.step`; also
    returns the class names of the modules its pipeline stages drive (DDP, FSDP2 wrappers)."""
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    out = []
    for spec, compiled in cases:
        model, inputs, _ = build(spec)
        module = compiled.parallelize(model)  # type: ignore[attr-defined]
        opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
        losses = []
        for batch in batches(inputs):
            loss = module.step(*batch)
            opt.step()
            opt.zero_grad()
            value = loss.detach().clone()
            dist.all_reduce(value)  # equal on model axes and pipeline ranks; data shares averaged
            losses.append(float(value) / world)
        full = compiled.full_state_dict(module)  # type: ignore[attr-defined]
        wrappers = sorted({type(stage.submod).__name__ for stage in getattr(module, "stages", [])})
        out.append((losses, {k: v.clone() for k, v in full.items()} if rank == 0 else {}, wrappers))
    return out


Case = tuple[str, str] | tuple[str, str, tuple[int, ...]]


def compile_cases(cases: list[Case]) -> list[tuple[str, object]]:
    """Compile every case for `step_cases` (fp32: exact); a `split` of blocks per stage is
    written into the layers before lowering."""
    import shardc

    compiled = []
    for spec, plan, *split in cases:
        model, inputs, names = build(spec)
        edit = (lambda g, s=tuple(split[0]): stage_split(g, s, len(s))) if split else None
        one = shardc.compile(model, inputs, plan=f"{plan},dtype=fp32", input_names=names, before_lower=edit)  # fp32: exact
        if split:
            blocks = [layer.annotation.stage for name, layer in one.runtime_graph.layers.items() if "." in name]
            assert [blocks.count(s) for s in range(len(split[0]))] == list(split[0]), (plan, split, blocks)
        compiled.append((spec, one))
    return compiled


def check_cases(cases: list[Case], results: list[tuple[list[float], dict, list[str]]]) -> None:
    """Rank 0's `step_cases` results against one process; stage modules must be DDP-wrapped for
    dp x pp and FSDP2 modules for ZeRO."""
    for (spec, plan, *_), (losses, full, wrappers) in zip(cases, results):
        check(spec, plan, losses, full)
        keys = dict(kv.split("=") for kv in plan.split(","))
        if "dp=2" in plan and "pp=2" in plan:
            want = "DistributedDataParallel" if keys.get("zero", "0") == "0" else "FSDP"
            assert all(w.startswith(want) for w in wrappers), (spec, plan, wrappers)


def run_and_check(world: int, cases: list[Case]) -> None:
    """Compile every case, train on `world` processes, compare with one process."""
    check_cases(cases, spawn(step_cases, world, compile_cases(cases), timeout_s=600)[0])


def test_pipelines_1f1b_gpipe_interleaved_and_accumulation_on_two_processes() -> None:
    run_and_check(2, [
        (GPT, "pp=2"),                                          # 1F1B, 4 micro-batches
        (LLAMA, "pp=2,schedule=gpipe"),
        (LLAMA, "pp=2"),                                        # 1F1B
        (HF_GPT2, "pp=2"),
        (GPT + FOUR_LAYERS, "pp=2,vpp=2"),                      # interleaved 1F1B, 4 virtual stages
        (LLAMA + FOUR_LAYERS, "pp=2,vpp=2"),
        (HF_GPT2.replace("n_layer=2", "n_layer=4"), "pp=2,vpp=2"),
        (GPT, "dp=2"),                                          # pp=1: accumulation over 2 micro-batches
        (GPT + FOUR_LAYERS, "pp=2", (3, 1)),                    # unbalanced stages (split=3+1)
    ])


def test_tensor_parallel_pipelines_on_four_processes() -> None:
    run_and_check(4, [
        (GPT, "tp=2,pp=2"),                                     # fused qkv: strided shards inside a stage
        (LLAMA, "tp=2,sp=1,pp=2"),
        (HF_GPT2, "tp=2,pp=2"),
        (LLAMA, "cp=2,pp=2"),                                   # ring attention inside a stage
        (GPT, "dp=2,pp=2"),                                     # DDP stage modules, synced in the last backward
        (GPT, "dp=2,pp=2,zero=1"),                              # FSDP2 stage modules
        (LLAMA, "dp=2,pp=2,zero=2"),
        (HF_GPT2, "dp=2,pp=2,zero=3"),                          # parameters gathered per micro-batch
    ])


def test_data_tensor_pipeline_parallel_on_eight_processes() -> None:
    run_and_check(8, [(GPT, "dp=2,tp=2,pp=2"), (LLAMA, "dp=2,tp=2,pp=2"), (HF_GPT2, "dp=2,tp=2,pp=2")])
