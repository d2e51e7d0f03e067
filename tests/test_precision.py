"""Mixed precision runs as priced (issue 13): bf16/fp16 plans over gloo against one process.

Every run trains GPT tiny through the plan's own runtime and the shared training loop's step
(`shardc.train.parallelized`, AdamW, `precision.scaled_step`), from the same seed and batches.
The one-process reference is the backend itself with a 1-device plan of the same dtype: the
same casts (the generated code's `.to(torch.bfloat16)`), on one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardc.backends.torch.launch import spawn

SPEC = "examples/gpt.py:tiny"
STEPS = 4
CLUSTER = "8xH100"


def compile_plan(plan: str) -> Any:
    import shardc
    from shardc.frontend.spec import load_model

    torch.manual_seed(0)
    loaded = load_model(SPEC, device="cpu")
    return shardc.compile(loaded.model, tuple(loaded.example_inputs), plan=plan)


def train_plans(rank: int, world: int, cases: list[tuple[Any, float | None]]) -> list[dict[str, Any]]:
    """On every rank: train each compiled plan STEPS steps (fp16: with a loss scaler of the given
    initial scale); the global mean losses, the scales used, whether each step was taken."""
    import torch.distributed as dist

    from shardc.backends.torch.parallelize import unwrap
    from shardc.backends.torch.precision import attach_scaler, grad_scaler, scaled_step, scaler_of
    from shardc.frontend.spec import load_model
    from shardc.train import parallelized, synthetic_batch, vocab_of

    torch.use_deterministic_algorithms(True)
    out = []
    for compiled, init_scale in cases:
        torch.manual_seed(0)
        loaded = load_model(SPEC, device="cpu")
        trainee = parallelized(compiled, loaded.model, torch.device("cpu"))
        if init_scale is not None:
            scaler = grad_scaler(torch.float16, init_scale=init_scale)
            attach_scaler(scaler, trainee.module, unwrap(trainee.module))
        optimizer = torch.optim.AdamW([p for p in trainee.module.parameters() if p.requires_grad], lr=1e-2,
                                      foreach=False)
        losses, scales, taken, dtypes = [], [], [], set()
        saved: dict[str, int] = {}
        for step in range(STEPS):
            batch = synthetic_batch(loaded.example_inputs, vocab_of(loaded.model), 0, step)
            if step == 0:  # what backward holds: every float activation in the compute dtype but the loss's
                with torch.autograd.graph.saved_tensors_hooks(lambda t: _note(saved, t), lambda t: t):
                    loss = trainee.step(batch).float().reshape(())
            else:
                loss = trainee.step(batch).float().reshape(())
            dtypes |= {str(p.grad.dtype) for p in trainee.module.parameters() if p.grad is not None}
            scaler = scaler_of(trainee.module)
            scales.append(scaler.get_scale() if scaler is not None else None)
            taken.append(scaled_step(optimizer, scaler))
            optimizer.zero_grad(set_to_none=False)
            dist.all_reduce(loss)
            losses.append(float(loss) / world)
        out.append({"losses": losses, "scales": scales, "taken": taken, "grad_dtypes": sorted(dtypes), "saved": saved})
    return out


def _note(saved: dict[str, int], t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and not isinstance(t, torch.nn.Parameter):
        key = str(t.dtype).removeprefix("torch.")
        saved[key] = saved.get(key, 0) + t.numel() * t.element_size()
    return t


def test_generated_code_casts_weights_and_inputs_and_reads_the_loss_in_fp32() -> None:
    """`module.code` shows the casts: every float parameter read in bf16, the loss's logits in fp32."""
    code = compile_plan("dp=2,tp=2,dtype=bf16").code(0)
    assert "blocks_0_attn_qkv_weight_bf16 = attn_qkv_weight.to(torch.bfloat16)" in code
    assert "ln_f_weight_bf16 = ln_f_weight.to(torch.bfloat16)" in code
    assert ".to(torch.float32)" in code  # the cross entropy's logits
    assert "idx_local.to(" not in code  # token ids are not floats
    assert ".to(torch." not in compile_plan("dp=2,tp=2,dtype=fp32").code(0)


def test_mixed_precision_plans_match_one_process_under_the_same_casts() -> None:
    plans = ["dp=2", "tp=2", "dp=2,zero=1", "pp=2,mb=1"]
    dtypes = ["bf16", "fp16"]
    two = [(compile_plan(f"{p},dtype={d}"), None) for d in dtypes for p in plans]
    results = spawn(train_plans, 2, two, timeout_s=600)[0]
    one = [(compile_plan(f"dp=1,dtype={d}"), None) for d in (*dtypes, "fp32")]
    refs = dict(zip((*dtypes, "fp32"), spawn(train_plans, 1, one, timeout_s=300)[0]))
    for k, (d, p) in enumerate((d, p) for d in dtypes for p in plans):
        got, ref, fp32 = results[k], refs[d], refs["fp32"]
        print(d, p, got["losses"], ref["losses"], fp32["losses"], got["grad_dtypes"], got["saved"], got["scales"], got["taken"], fp32["saved"])
