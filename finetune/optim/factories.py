"""The registry's optimizer factories: (opt, learning_rate) -> a function (groups, seed_offset=0) -> optimizer.

`seed_offset` numbers the parameters for APOLLO's random projections (layer-wise mode builds one optimizer
per parameter); the others ignore it. Each factory imports its optional package only when called.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from finetune.recipe.schema import OptimizerConfig

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps smaller tensors' state in fp32

Factory = Callable[..., torch.optim.Optimizer]


def adamw(opt: OptimizerConfig, learning_rate: float) -> Factory:
    return lambda groups, seed_offset=0: torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(opt.betas),
                                                           eps=opt.eps)


def sgd(opt: OptimizerConfig, learning_rate: float) -> Factory:
    return lambda groups, seed_offset=0: torch.optim.SGD(groups, lr=learning_rate, momentum=opt.momentum)


def adafactor(opt: OptimizerConfig, learning_rate: float) -> Factory:
    return lambda groups, seed_offset=0: torch.optim.Adafactor(groups, lr=learning_rate)


def _bnb(cls: type, opt: OptimizerConfig, learning_rate: float) -> Factory:
    return lambda groups, seed_offset=0: cls(groups, lr=learning_rate, betas=tuple(opt.betas), eps=opt.eps,
                                             min_8bit_size=BNB_MIN_8BIT_SIZE)


def adamw_8bit(opt: OptimizerConfig, learning_rate: float) -> Factory:
    import bitsandbytes as bnb

    return _bnb(bnb.optim.AdamW8bit, opt, learning_rate)


def paged_adamw_8bit(opt: OptimizerConfig, learning_rate: float) -> Factory:
    import bitsandbytes as bnb

    return _bnb(bnb.optim.PagedAdamW8bit, opt, learning_rate)


def galore_8bit(opt: OptimizerConfig, learning_rate: float) -> Factory:
    from galore_torch import GaLoreAdamW8bit

    return _bnb(GaLoreAdamW8bit, opt, learning_rate)


def low_rank(opt: OptimizerConfig, learning_rate: float) -> Factory:
    from finetune.optim.lowrank import LowRankAdamW

    return lambda groups, seed_offset=0: LowRankAdamW(groups, lr=learning_rate, betas=tuple(opt.betas), eps=opt.eps,
                                                      seed_offset=seed_offset)
