"""DFlash draft training for speculative decoding: module.py (``DFlashModule``), model.py (``DFlashDraft``)."""
