"""The causal-LM family's model: the shared backbone, :class:`~lit_dllm.core.backbone.CausalLM`, trained as it is.

The wrapper lives in :mod:`lit_dllm.core.backbone` because the MDLM family builds on it too; its names stay
importable from here.
"""

from lit_dllm.core.backbone import CausalLM, TokenNLL
from lit_dllm.hub.hf import grow_embeddings

__all__ = ["CausalLM", "TokenNLL", "grow_embeddings"]
