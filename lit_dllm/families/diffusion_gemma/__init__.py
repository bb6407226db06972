"""Block-diffusion Gemma (transformers' DiffusionGemma): module.py (``BlockDiffusionGemmaModule``), model.py
(``BlockDiffusionGemma``), masks.py (the block-causal decoder and causal encoder masks)."""
