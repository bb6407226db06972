"""Reinforcement-learning post-training of dLLMs (diffu-GRPO and kin): reward functions in :mod:`.rewards`,
the ``rl`` settings group (:class:`~lit_dllm.rl.settings.Reinforcement`) in :mod:`.settings`."""
