"""Block-diffusion Gemma (transformers' DiffusionGemma): module.py (``BlockDiffusionGemmaModule``), model.py
(``BlockDiffusionGemma``)."""
