"""Building a family's transformers backbone from its module's hyper-parameters: the MDLM and causal-LM families
(and any family that trains a Hugging Face causal-LM stack) share this, so neither imports the other."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_dllm.core.backbone import CausalLM
from lit_dllm.core.token_loss import TokenLossModule
from lit_dllm.hub.hf import grow_embeddings, load_causal_lm

__all__ = ["build_backbone"]


def build_backbone(module: TokenLossModule, wrapper: type[CausalLM], chunk_size: int, fused: bool,
                   **config_defaults: Any) -> CausalLM:
    """``module``'s transformers model wrapped in ``wrapper`` (:class:`CausalLM` or a subclass, with its LM head's
    ``chunk_size`` and ``fused``).

    Reads the module's ``backbone`` group (:class:`~lit_dllm.settings.CausalBackbone`: ``model`` with
    ``gguf_file``, or ``model_config``, whose missing keys ``vocab_size`` and ``config_defaults`` fill) and its
    tokenizer's ``trust_remote_code``. Warns when the
    connected data's ``max_seq_len`` exceeds the model's positions. A pretrained model with fewer embedding rows than
    the tokenizer has tokens grows them (:func:`~lit_dllm.hub.hf.grow_embeddings`); a ``model_config``
    that sets a smaller ``vocab_size`` is an error.
    """
    backbone, vocab_size = module.backbone, module.vocab_size
    config = backbone.model_config
    config = None if config is None else {"vocab_size": vocab_size, **config_defaults, **config}
    hf_model = load_causal_lm(
        backbone.model,
        config,
        trust_remote_code=module.tokenizer_settings.trust_remote_code,
        torch_dtype=backbone.torch_dtype,
        attn_implementation=backbone.attn_implementation,
        gguf_file=backbone.gguf_file,
    ).train()  # from_pretrained returns eval mode (dropout off); Lightning keeps a module's mode
    max_positions = getattr(hf_model.config, "max_position_embeddings", None)
    max_seq_len = module.data_max_seq_len  # the data's, once connected (lit_dllm.data.handoff)
    if max_positions is not None and max_seq_len is not None and max_positions < max_seq_len:
        rank_zero_warn(
            f"The model's max_position_embeddings={max_positions} < the data's max_seq_len={max_seq_len}: "
            "absolute-position models fail on longer rows and RoPE models run untested positions. Raise "
            "max_position_embeddings (model_config) or lower data.init_args.max_seq_len."
        )
    rows = hf_model.get_input_embeddings().weight.shape[0]
    if rows < vocab_size and backbone.model_config is not None:
        raise ValueError(
            f"model_config's vocab_size={rows} is smaller than the tokenizer's {vocab_size} tokens (mask id "
            f"{module.mask_token_id}): drop vocab_size from model_config (it defaults to the tokenizer's) or raise it."
        )
    if rows < vocab_size:
        multiple = backbone.pad_vocab_multiple_of
        grow_embeddings(hf_model, vocab_size, multiple)
        grown = hf_model.get_input_embeddings().weight.shape[0]
        rank_zero_info(
            f"Grew the embeddings of {backbone.model!r} from {rows} to {grown} "
            f"rows for the tokenizer's {vocab_size} tokens (added tokens start at the mean embedding"
            f"{f', padded to a multiple of {multiple}' if multiple else ''})."
        )
    return wrapper(hf_model, chunk_size=chunk_size, fused=fused)
