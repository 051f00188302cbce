"""`finetune eval`: a run's held-out loss and perplexity, and the match of its greedy answers with expected
ones, beside the base model's and other runs' (finetune.evaluate.run)."""
