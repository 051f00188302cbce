"""finetune: fine-tune open language models on one consumer GPU, with the memory planned before the run."""

__version__ = "0.1.0"
