"""Reinforcement learning with verifiable rewards (GRPO family): the loss, the advantages, rewards, prompt data.

Components a training loop calls (`step`: generate and score, then the loss per micro-batch); `finetune run`
refuses training.method grpo until the loop calls them (docs/rl.md says what is left).
"""
