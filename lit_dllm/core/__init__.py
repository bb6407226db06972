"""The family-neutral core: the LightningModule bases (:mod:`~lit_dllm.core.token_loss`: ``TokenLossModule``, any
family; :mod:`~lit_dllm.core.base`: ``DLLMModule``, masked diffusion), generation and answer scoring
(:mod:`~lit_dllm.core.generation`), the settings groups the families' constructors share
(:mod:`~lit_dllm.settings`: backbone, generation), the default optimiser (:mod:`~lit_dllm.core.optim`), and
backbone loading: the fused-head causal-LM wrapper (:mod:`~lit_dllm.core.backbone`), building it from a module's
hyper-parameters (:mod:`~lit_dllm.core.build_backbone`, from the Hugging Face and GGUF sources of :mod:`lit_dllm.hub`).
Nothing here imports a family (:mod:`lit_dllm.families`)."""
