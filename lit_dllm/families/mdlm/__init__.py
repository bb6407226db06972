"""MDLM / LLaDA masked diffusion and its hybrid diffusion + AR variant: module.py (``MDLMModule``,
``HybridMDLMModule``), model.py (``DiffusionLM``), sampler.py (LLaDA) and fast_sampler.py (Fast-dLLM)."""
