"""The forward process, below :mod:`lit_dllm.data`: keyed random draws and the one registry of their streams
(:mod:`~lit_dllm.noise.keys`), the corruption kernels (:mod:`~lit_dllm.noise.corruption`) and their Triton launches
(:mod:`~lit_dllm.noise.fused_corruption`). It imports only PyTorch (and Triton, lazily); the families, ``core`` and
``rl`` call it, the data module does not."""
