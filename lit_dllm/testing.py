"""Tiny model shapes for tests and benchmarks: the ``model_config`` / ``draft_config`` dicts that build each family's
model offline in seconds on a CPU (random weights, through the same loading code as real checkpoints).

``tests/`` and ``bench/`` import them from here; copy one (``dict(TINY_LLAMA, ...)``) before changing it.
"""

__all__ = ["TINY_DFLASH_DRAFT", "TINY_DIFFUSION_GEMMA", "TINY_LLAMA", "TINY_MOE"]

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}

TINY_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 64,
}
"""A tiny Qwen3-MoE (``model_config``): 2 layers, every MLP 8 experts (intermediate 16) with top-2 routing."""

TINY_DIFFUSION_GEMMA = {
    "canvas_length": 4,
    "text_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 16,
        "num_global_key_value_heads": 1,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 16,
        "max_position_embeddings": 64,
    },
    "vision_config": {
        "model_type": "gemma4_vision",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
    },
}
"""DiffusionGemma ``model_config`` (``BlockDiffusionGemmaModule``): 4 layers, sliding and full, 4 experts top-2."""


TINY_DFLASH_DRAFT = {"num_hidden_layers": 2, "intermediate_size": 64}
"""DFlash ``draft_config`` (``DFlashModule``) over a ``TINY_LLAMA`` target: 2 layers; hidden size, heads, RoPE and norm
eps come from the target."""
