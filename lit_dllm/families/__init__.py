"""One folder per model family: ``module.py`` (its LightningModule), ``model.py`` (its plain single-device
``nn.Module``, no Lightning) and, where it has its own, ``sampler.py``. A family imports :mod:`lit_dllm.core`,
:mod:`lit_dllm.data` and the top-level utilities, never another family; the public classes are exported by
:mod:`lit_dllm` (``lit_dllm.MDLMModule``, ...), the names configs use."""
