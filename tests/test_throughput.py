"""Peak FLOP/s by card and precision, and the model FLOPs of a training step, against hand-derived numbers."""

import pytest
import torch

from lit_dllm import BlockDiffusionGemmaModule, HybridMDLMModule, MDLMModule
from lit_dllm.testing import TINY_DIFFUSION_GEMMA, TINY_LLAMA, TINY_MOE
from lit_dllm.throughput import peak_flops

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(("name", "precision", "matmul", "expected"), [
    ("NVIDIA H200", "bf16-mixed", "highest", 989.5e12),
    ("NVIDIA H200", "bf16-true", "highest", 989.5e12),
    ("NVIDIA H200", "32-true", "high", 494.5e12),  # tf32
    ("NVIDIA H200", "32-true", "highest", 67e12),
    ("NVIDIA H100 80GB HBM3", "bf16-mixed", "highest", 989.5e12),
    ("NVIDIA H100 80GB HBM3", "16-mixed", "highest", 989.5e12),
    ("NVIDIA H100 80GB HBM3", "32-true", "high", 494.5e12),
    ("NVIDIA H100 PCIe", "bf16-mixed", "highest", 756.5e12),
    ("NVIDIA H100 PCIe", "32-true", "highest", 51e12),
    ("NVIDIA H100 NVL", "bf16-true", "highest", 835.5e12),
    ("NVIDIA H200 NVL", "bf16-mixed", "highest", 835.5e12),
    ("NVIDIA H200 NVL", "32-true", "medium", 417.5e12),
    ("NVIDIA H200 NVL", "32-true", "highest", 60e12),
    ("NVIDIA H200", "64-true", "highest", None),
    ("NVIDIA A100-SXM4-80GB", "bf16-mixed", "highest", 312e12),  # Lightning's table
])
def test_peak_flops_by_card_and_precision(monkeypatch, name, precision, matmul, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: matmul)
    assert peak_flops(CUDA, precision) == expected


def test_no_peak_on_a_cpu():
    assert peak_flops(torch.device("cpu"), "32-true") is None


def tiny_llama_flops(rows: int, length: int, vocab: int) -> int:
    """TINY_LLAMA by hand: hidden 32, 2 layers, 4 heads of 8 (2 KV heads), MLP 64, untied head; norms count."""
    attention = 32 * 32 + 2 * 32 * 16 + 32 * 32  # q, k, v, o
    layer = attention + 3 * 32 * 64 + 2 * 32  # + gate, up, down, two norms
    params = 2 * layer + 32 + 32 * vocab  # + final norm, LM head (the input embedding is no matmul)
    return 6 * params * rows * length + 12 * 2 * 32 * length * length * rows  # + scores and weighted values


@pytest.mark.parametrize(("module", "passes"), [(MDLMModule, 1), (HybridMDLMModule, 2)])
def test_training_flops_of_a_tiny_llama_equal_the_hand_formula(module, passes):
    model = module(vocab_size=100, mask_token_id=99, backbone={"model_config": TINY_LLAMA})
    model.configure_model()
    batch = {"input_ids": torch.zeros(3, 16, dtype=torch.long)}
    assert model.training_flops(batch) == passes * tiny_llama_flops(3, 16, 100) == passes * 6_865_920


def test_training_flops_of_a_tiny_qwen3_moe_count_the_top_2_of_8_experts():
    """TINY_MOE by hand: hidden 32, 2 layers, 4 heads of 8 (2 KV heads) with q/k norms, a router over 8 experts of
    intermediate 16 of which a token runs 2 (the active parameters), untied head."""
    attention = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 2 * 8  # q, k, v, o, q/k norms
    experts = 2 * (2 * 16 * 32 + 32 * 16)  # gate_up and down of the 2 experts a token runs (8 held)
    layer = attention + 8 * 32 + experts + 2 * 32  # + router, two norms
    params = 2 * layer + 32 + 32 * 100  # + final norm, LM head
    module = MDLMModule(vocab_size=100, mask_token_id=99, backbone={"model_config": TINY_MOE})
    module.configure_model()
    batch = {"input_ids": torch.zeros(3, 16, dtype=torch.long)}
    assert module.training_flops(batch) == 6 * params * 3 * 16 + 12 * 2 * 32 * 16 * 16 * 3 == 5_253_120


def test_frozen_parameters_cost_a_forward_only():
    model = MDLMModule(vocab_size=100, mask_token_id=99, backbone={"model_config": TINY_LLAMA},
                       frozen_modules=["model.hf.lm_head"])
    model.configure_model()
    batch = {"input_ids": torch.zeros(3, 16, dtype=torch.long)}
    assert model.training_flops(batch) == tiny_llama_flops(3, 16, 100) - 4 * 32 * 100 * 3 * 16


def test_training_flops_of_block_diffusion_gemma_follow_its_three_passes():
    """The tiny DiffusionGemma: one stack's active matmul weights (top-2 of 4 experts, by hand), the encoder pass with
    gradients over the sequence, two decoder passes over the response window."""
    module = BlockDiffusionGemmaModule(vocab_size=100, pad_token_id=0, eos_token_id=1,
                                       backbone={"model_config": TINY_DIFFUSION_GEMMA},
                                       generation={"val_generate_batches": 0})
    module.configure_model()
    text = module.model.text_config
    sliding = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 2 * 16  # q (2 heads of 16), k, v (1 KV head), o, q/k norms
    full = 32 * 32 + 32 * 16 + 32 * 32 + 2 * 16  # no v: a full-attention layer's keys are its values
    experts = 2 * (2 * 16 * 32 + 32 * 16)  # gate_up and down of the 2 experts a token runs (4 held)
    rest = 3 * 32 * 64 + 7 * 32 + (4 * 32 + 32 + 4) + experts  # dense MLP, 7 norms, router (proj, scales)
    stack = 2 * (sliding + rest) + 2 * (full + rest) + 32 + 32 + 3 * 32 * 64  # + final norm, self-conditioning
    assert stack == 56_016
    head = module.model.hf.lm_head.weight.numel()
    loss_mask = torch.zeros(2, 12)
    loss_mask[0, 4:] = loss_mask[1, 8:] = 1  # response windows of 8 and 4 tokens
    batch = {"input_ids": torch.zeros(2, 12, dtype=torch.long), "loss_mask": loss_mask,
             "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    attention = lambda keys: 4 * text.num_hidden_layers * text.num_attention_heads * text.head_dim * keys  # noqa: E731
    encoder = 12 * (6 * stack + 6 * head + 3 * attention(12))
    decoder = 8 * (2 * stack + 2 * head + attention(20)) + 8 * (6 * stack + 3 * attention(20))
    expected = 2 * (encoder + decoder + 6 * head * module.canvas_length)
    assert module.training_flops(batch) == pytest.approx(expected, rel=1e-12)


def test_attention_flops_add_up_heterogeneous_layers():
    """DiffusionGemma's full-attention layers with wider heads (global_head_dim 32 against 16): transformers refuses
    ``config.head_dim`` on such a config; each layer counts its own heads x head_dim. A uniform Llama: layers x heads x
    head_dim."""
    from transformers import LlamaConfig
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaConfig

    from lit_dllm.throughput import attention_flops

    text = dict(TINY_DIFFUSION_GEMMA["text_config"], global_head_dim=32)
    config = DiffusionGemmaConfig(**dict(TINY_DIFFUSION_GEMMA, text_config=text)).get_text_config()
    assert attention_flops(config, 10) == 4 * (2 * 16 + 2 * 32 + 2 * 16 + 2 * 32) * 10
    llama = LlamaConfig(**{key: value for key, value in TINY_LLAMA.items() if key != "model_type"})
    assert attention_flops(llama, 10) == 4 * 2 * 4 * 8 * 10
