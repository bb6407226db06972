"""lit_dllm: diffusion language model training on PyTorch Lightning."""

from lit_dllm.core.base import DLLMModule
from lit_dllm.settings import (
    Backbone,
    BuiltinTask,
    CausalBackbone,
    Collation,
    DataSource,
    DenoisingGeneration,
    Formatting,
    Generation,
    Loader,
    Optimization,
    Parallelism,
    Splits,
    Tokenizer,
)
from lit_dllm.rl.settings import Reinforcement
from lit_dllm.strategies import DDPStrategy, ExpertParallelStrategy, SingleDeviceStrategy
from lit_dllm.core.token_loss import StepLoss, TokenLossModule
from lit_dllm.core.trace import DenoisingTrace
from lit_dllm.data.collate import DLLMCollator
from lit_dllm.noise.corruption import (
    _batched_gumbel_topk,
    batched_gumbel_topk,
    corrupt_all_masked,
    corrupt_blockwise,
    corrupt_mix,
    corrupt_uniform,
    corrupt_uniform_random,
    gumbel_topk,
)
from lit_dllm.data.datamodule import DLLMDataModule
from lit_dllm.noise.keys import example_keys
from lit_dllm.data.tasks import TASKS, make_task_dataset
from lit_dllm.data.tokenizer import build_default_tokenizer, load_tokenizer, unused_special_tokens
from lit_dllm.families.causal_lm.module import CausalLMModule
from lit_dllm.families.dflash.loss import DFlashDecayLoss
from lit_dllm.families.dflash.masks import create_dflash_attention_mask, create_dflash_block_mask
from lit_dllm.families.dflash.module import DFlashGeneration, DFlashModule
from lit_dllm.families.diffusion_gemma.masks import (
    block_diffusion_batch_mask,
    block_diffusion_block_mask,
    build_block_diffusion_training_mask,
    encoder_attention_masks,
    encoder_block_masks,
)
from lit_dllm.families.diffusion_gemma.module import BlockDiffusionGemmaModule
from lit_dllm.families.causal_lm.grpo import CausalGRPOModule
from lit_dllm.families.mdlm.grpo import DiffuGRPOModule
from lit_dllm.families.mdlm.module import HybridMDLMModule, LLaDAGeneration, MDLMModule
from lit_dllm.families.mdlm.sampler import llada_generate
from lit_dllm.losses import DLLMLossOutput, fused_linear_cross_entropy, weighted_linear_cross_entropy
from lit_dllm.reference.losses import (
    BlockDiffusionCrossEntropyLoss,
    HybridDiffusionLLMLoss,
    MDLMCrossEntropyLoss,
    encoder_ar_loss,
)

__all__ = [
    "Backbone",
    "CausalBackbone",
    "DenoisingGeneration",
    "DFlashGeneration",
    "Generation",
    "LLaDAGeneration",
    "Optimization",
    "Parallelism",
    "Reinforcement",
    "Tokenizer",
    "BuiltinTask",
    "Collation",
    "DataSource",
    "Formatting",
    "Loader",
    "Splits",
    "DDPStrategy",
    "ExpertParallelStrategy",
    "SingleDeviceStrategy",
    "BlockDiffusionGemmaModule",
    "CausalLMModule",
    "CausalGRPOModule",
    "DiffuGRPOModule",
    "DFlashModule",
    "DLLMDataModule",
    "DLLMModule",
    "DenoisingTrace",
    "HybridMDLMModule",
    "MDLMModule",
    "StepLoss",
    "TokenLossModule",
    "TASKS",
    "build_default_tokenizer",
    "llada_generate",
    "load_tokenizer",
    "unused_special_tokens",
    "make_task_dataset",
    "BlockDiffusionCrossEntropyLoss",
    "DFlashDecayLoss",
    "DLLMCollator",
    "DLLMLossOutput",
    "HybridDiffusionLLMLoss",
    "MDLMCrossEntropyLoss",
    "_batched_gumbel_topk",
    "batched_gumbel_topk",
    "block_diffusion_batch_mask",
    "block_diffusion_block_mask",
    "build_block_diffusion_training_mask",
    "corrupt_all_masked",
    "corrupt_blockwise",
    "corrupt_mix",
    "corrupt_uniform",
    "corrupt_uniform_random",
    "create_dflash_attention_mask",
    "create_dflash_block_mask",
    "encoder_ar_loss",
    "encoder_attention_masks",
    "encoder_block_masks",
    "example_keys",
    "fused_linear_cross_entropy",
    "weighted_linear_cross_entropy",
    "gumbel_topk",
]
