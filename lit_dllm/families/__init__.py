"""One folder per model family: ``module.py`` (its LightningModule), ``model.py`` (its plain single-device
``nn.Module``, no Lightning) and, where it has its own, ``sampler.py``, ``masks.py`` and ``loss.py``. A family imports
:mod:`lit_dllm.core` and the rooms below it, never another family; the public classes are exported by
:mod:`lit_dllm` (``lit_dllm.MDLMModule``, ...), the names configs use."""
