"""Routing skew measured: the busiest expert-parallel rank's routed tokens over the balanced share.

    .venv/bin/python benchmarks/routing_skew.py [--batches 4] [--seed 0]

`shardc.cost.moe.DEFAULT_ROUTING_SKEW` is this script's figure. Method: small transformers MoE
models (mixtral, qwen3_moe, deepseek_v3; hidden 64, 8 routed experts, top-2), freshly initialised
as transformers initialises them, run forward on batches of uniformly random token ids (the
synthetic data NeMo's and Megatron's MoE benchmarks train on). A forward pre-hook on every
expert block reads the router's top-k indices; for an ep group of n ranks (rank r holding experts
r*E/n .. (r+1)*E/n - 1) the skew of one micro-batch in one layer is max over ranks of its routed
token-expert pairs over their mean. Reported per model, ep degree and tokens per ep group (one
micro-batch of the group: 8 ranks x 4096 tokens is the published rows'), averaged over layers and
batches; the default is the mean over the models at 32768 tokens, per ep degree.

What it measures is an untrained router's imbalance on random tokens, the condition of the
benchmarks' first steps and of synthetic-data throughput runs; a trained router on real text
with an auxiliary loss sits elsewhere, and Megatron's README warns that dropless MoE is much
more imbalanced in the first few hundred steps of real training. Runs that pad every expert to
its capacity (capacity factor 1.0) or force-balance routing have skew 1.0 by construction.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

# Small configurations of the three MoE types shardc captures (`shardc.ops.moe`), 8 experts top-2.
MODELS: dict[str, dict[str, Any]] = {
    "mixtral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}
EXPERTS = 8
VOCAB = 32000
EP_DEGREES = (2, 4, 8)
# (sequences, tokens per sequence) of one ep group's micro-batch: 4096 and 32768 tokens (8 ranks x
# 4096, the published rows' micro-batch, as 512-token sequences: routing is per token, and short
# sequences keep the attention matrices small on a CPU).
GROUPS = ((8, 512), (64, 512))


def build(model_type: str, seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, use_cache=False, **MODELS[model_type])
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def routed_indices(model: torch.nn.Module, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The top-k expert indices every expert block receives, one (tokens, k) tensor per layer."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].detach().clone()))
             for name, m in model.named_modules() if type(m).__name__.endswith("Experts")]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    if not seen:
        raise RuntimeError(f"{type(model).__name__}: no expert block (a module named ...Experts) saw any token")
    return seen


def skew(index: torch.Tensor, ranks: int, experts: int = EXPERTS) -> float:
    """Busiest rank's token-expert pairs over the mean, ranks holding contiguous expert ranges."""
    per_expert = torch.bincount(index.flatten(), minlength=experts).double()
    per_rank = per_expert.view(ranks, experts // ranks).sum(dim=1)
    return float(per_rank.max() / per_rank.mean())


def measure(batches: int, seed: int) -> dict[tuple[str, int, int], float]:
    """(model, ep, tokens per group) -> mean skew over layers and batches."""
    out: dict[tuple[str, int, int], float] = {}
    generator = torch.Generator().manual_seed(seed)
    for model_type in MODELS:
        model = build(model_type, seed)
        for sequences, length in GROUPS:
            samples: dict[int, list[float]] = {n: [] for n in EP_DEGREES}
            for _ in range(batches):
                ids = torch.randint(0, VOCAB, (sequences, length), generator=generator)
                for index in routed_indices(model, ids):
                    for n in EP_DEGREES:
                        samples[n].append(skew(index, n))
            for n in EP_DEGREES:
                out[(model_type, n, sequences * length)] = statistics.fmean(samples[n])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = measure(args.batches, args.seed)
    tokens = sorted({t for _, _, t in results})
    print("| model | tokens per ep group | " + " | ".join(f"ep={n}" for n in EP_DEGREES) + " |")
    print("|---|---|" + "---|" * len(EP_DEGREES))
    for model_type in MODELS:
        for t in tokens:
            print(f"| {model_type} | {t} | " + " | ".join(f"{results[(model_type, n, t)]:.3f}" for n in EP_DEGREES)
                  + " |")
    print(f"\nmean over the models at {max(tokens)} tokens per group (shardc.cost.moe.MEASURED_ROUTING_SKEW):")
    print(", ".join(f"ep={n}: {v:.2f}" for n, v in defaults(results).items()))
    return 0


def defaults(results: dict[tuple[str, int, int], float]) -> dict[int, float]:
    """ep degree -> the mean skew over the models at the largest group measured."""
    largest = max(t for _, _, t in results)
    return {n: statistics.fmean(results[(m, n, largest)] for m in MODELS) for n in EP_DEGREES}


if __name__ == "__main__":
    raise SystemExit(main())
