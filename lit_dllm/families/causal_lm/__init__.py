"""Plain autoregressive (next-token) training: module.py (``CausalLMModule``), model.py (the core backbone as
this family trains it)."""
