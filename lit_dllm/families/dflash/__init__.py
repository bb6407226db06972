"""DFlash draft training for speculative decoding: module.py (``DFlashModule``), model.py (``DFlashDraft``), masks.py
(the draft's attention mask), loss.py (``DFlashDecayLoss``)."""
