"""Hugging Face and GGUF sources, below :mod:`lit_dllm.data` and :mod:`lit_dllm.core`: loading and checking backbones
and their configs (:mod:`~lit_dllm.hub.hf`), GGUF files as a model and tokenizer source (:mod:`~lit_dllm.hub.gguf`),
and the repeated blocks of a transformers model (:mod:`~lit_dllm.hub.blocks`). It imports only
:mod:`lit_dllm.compat` and third-party libraries."""
