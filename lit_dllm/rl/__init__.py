"""Reinforcement-learning post-training of dLLMs (diffu-GRPO and kin): reward functions in :mod:`.rewards`."""
