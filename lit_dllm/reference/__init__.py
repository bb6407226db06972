"""Reference-parity formulations: NeMo AutoModel's dLLM loss API, computed on full ``[B, L, V]`` logits.

No family trains through these; each family's fused, chunked path (the LM head applied only at the scored
positions) is tested against them, value and gradient. They keep the reference's names and signatures, so a user
of the reference switches by changing one import; ``lit_dllm`` exports them too.
"""

from lit_dllm.reference.losses import (
    BlockDiffusionCrossEntropyLoss,
    HybridDiffusionLLMLoss,
    MDLMCrossEntropyLoss,
    encoder_ar_loss,
)

__all__ = ["BlockDiffusionCrossEntropyLoss", "HybridDiffusionLLMLoss", "MDLMCrossEntropyLoss", "encoder_ar_loss"]
