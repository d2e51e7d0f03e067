"""The model types `benchmarks/coverage.py` checks, and the tiny config of each as an `hf:` spec
(one layer per stack, hidden 64, vocabulary 128, dropout off, the model computing its own loss)."""

from __future__ import annotations

import re
from typing import Any

# (model type, kind): the kinds are the table's groups.
TYPES: tuple[tuple[str, str], ...] = (
    ("gpt2", "decoder"), ("gptj", "decoder"), ("gpt_neox", "decoder"),
    ("codegen", "decoder"), ("llama", "decoder"), ("mistral", "decoder"), ("qwen2", "decoder"),
    ("qwen3", "decoder"), ("phi", "decoder"), ("phi3", "decoder"), ("gemma", "decoder"),
    ("gemma2", "decoder"), ("granite", "decoder"), ("cohere", "decoder"), ("stablelm", "decoder"),
    ("starcoder2", "decoder"), ("olmo", "decoder"), ("olmo2", "decoder"), ("opt", "decoder"),
    ("bloom", "decoder"), ("falcon", "decoder"), ("biogpt", "decoder"),
    ("bert", "encoder"), ("roberta", "encoder"), ("distilbert", "encoder"), ("electra", "encoder"),
    ("albert", "encoder"), ("deberta-v2", "encoder"),
    ("bart", "encoder-decoder"), ("mbart", "encoder-decoder"), ("t5", "encoder-decoder"),
    ("mixtral", "moe"), ("qwen3_moe", "moe"), ("deepseek_v3", "moe"), ("olmoe", "moe"),
)

# The tiny config: each key is set where the type's config has it (aliases included).
TINY: dict[str, Any] = {
    "num_hidden_layers": 1, "num_layers": 1, "num_decoder_layers": 1, "encoder_layers": 1, "decoder_layers": 1,
    "n_layers": 1, "hidden_size": 64, "d_model": 64, "dim": 64, "num_attention_heads": 4, "num_heads": 4,
    "n_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "d_ff": 128, "hidden_dim": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "d_kv": 16, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64,
    "rotary_dim": 8, "embedding_size": 64, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 0,
    "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0, "tie_word_embeddings": False,
}
SHAPE = "batch=2&seq=16&labels=true"
# Per type: what the generic tiny config gets wrong (None: leave the key out).
OVERRIDES: dict[str, dict[str, Any]] = {
    "falcon": {"head_dim": None, "multi_query": False},  # one key/value head cannot split on tp=2
    "deepseek_v3": {"head_dim": 8, "num_key_value_heads": 4},  # head_dim: its rotary part, qk_rope_head_dim
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "deberta-v2": {"pooler_hidden_size": 64},
}


def spec_of(model_type: str) -> str:
    """The `hf:` spec of a type's tiny config: the TINY keys its config has, dropout off."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]()
    values = {k: v for k, v in TINY.items() if hasattr(defaults, k)} | OVERRIDES.get(model_type, {})
    for key, value in defaults.to_dict().items():
        if isinstance(value, float) and value > 0 and re.search(r"drop|pdrop", key) and "layerdrop" not in key:
            values[key] = 0.0
    for key, value in OVERRIDES.get(model_type, {}).items():
        if value is None:
            del values[key]
    query = "&".join(f"{k}={'none' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in values.items())
    return f"hf:{model_type}?{query}&{SHAPE}"
