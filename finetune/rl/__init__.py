"""Reinforcement learning with verifiable rewards (GRPO family): the loss, the advantages, rewards, prompt data.

Components a training loop calls; no `training.method` uses them yet (docs/rl.md says what is left).
"""
