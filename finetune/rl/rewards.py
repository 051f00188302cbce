"""Score completions with the configured rewards (finetune/recipe/rewards.py): built-ins and the user's functions.

Every reward function has TRL's signature, `fn(prompts, completions, **fields) -> list[float | None]`, where
each field of the records (the `answer`, ...) comes as a list aligned with the completions; a completion is a
string, or a list of messages whose last one is the answer (conversational prompts), as in TRL. None means "does
not apply" and becomes NaN: `group_advantages` leaves it out. Anything else that is not a finite number, and any
exception, stops the run with a RewardError that names the record (its file:line) and the reward.

User code runs only when the config sets `trust_python_code` and the caller allows it (`allow_python_code`):
the CLI allows it, a web server passes its own setting so a shared UI refuses unless its operator allowed it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError
from finetune.recipe.rewards import AnswerReward, FormatReward, LengthReward, PythonReward, RewardsConfig

RewardFn = Callable[..., list[Any]]


class RewardError(FinetuneError):
    """A reward function failed or returned something that is not a reward; exit code 2 (the user's setup)."""

    exit_code = 2


@dataclass(frozen=True)
class NamedReward:
    """A reward function with its config key (`rewards[0]`), what it is (`answer`, `my.py:score`) and weight."""

    key: str
    name: str
    weight: float
    fn: RewardFn


def build_rewards(config: RewardsConfig, base_dir: str | Path = ".", *,
                  allow_python_code: bool = True) -> list[NamedReward]:
    """The reward functions of `config`; kind python files are found relative to `base_dir` (the recipe's folder).

    `allow_python_code` False (a server that does not run its users' code) refuses kind python whatever the
    config says."""
    out = []
    for i, reward in enumerate(config.rewards):
        key = f"rewards[{i}]"
        if isinstance(reward, PythonReward):
            if not allow_python_code:
                raise RewardError(f"{key}: kind python ({reward.function}) runs code, and this server does not "
                                  "allow user code; use a built-in reward or run it with the finetune CLI")
            file, _, function = reward.function.rpartition(":")
            name = f"{Path(file).name}:{function}"  # the file's name, not the absolute path load_recipe made
            out.append(NamedReward(key, name, reward.weight, load_function(reward.function, base_dir, key)))
        else:
            out.append(NamedReward(key, reward.kind, reward.weight, _BUILT_IN[type(reward)](reward)))
    return out


def check_reward_files(config: RewardsConfig, base_dir: str | Path = ".", prefix: str = "") -> None:
    """Every kind python reward's file exists (nothing is imported): the seconds-long check before a model
    loads (finetune.api.preflight); RewardError naming the key (`grpo.rewards[1].function`) otherwise."""
    for key, file in config.python_files(prefix):
        _existing(Path(base_dir) / file, key)


def _existing(file: Path, key: str) -> Path:
    path = file.resolve()
    if not path.is_file():
        raise RewardError(f"{key}: {path} does not exist", hint="the file is relative to the recipe's folder")
    return path


def load_function(reference: str, base_dir: str | Path, key: str) -> RewardFn:
    """`file.py:function` imported from its file (relative to base_dir); RewardError if it is not there."""
    name = reference.rpartition(":")[2]
    path = _existing(Path(base_dir) / reference.rpartition(":")[0], f"{key}.function")
    module_name = f"finetune_reward_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001 - the user's module: any failure is reported as theirs
        raise RewardError(f"{key}.function: importing {path} failed ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"{key}.function: {path} has no function {name!r}")
    return fn


def score(rewards: Sequence[NamedReward], prompts: Sequence[Any], completions: Sequence[Any],
          records: Sequence[dict[str, Any]], where: Sequence[str]) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted sum per completion (NaN when no reward applies) and each reward's values by key.

    `records` and `where` (file:line) are the record each completion answers, aligned with `completions`."""
    keys = dict.fromkeys(k for r in records for k in r)  # a record without a field gets None for it
    fields = {k: [r.get(k) for r in records] for k in keys}
    per_reward = {r.key: _call(r, prompts, completions, fields, where) for r in rewards}
    totals = []
    for j in range(len(completions)):
        values = [(r.weight, per_reward[r.key][j]) for r in rewards]
        scored = [w * v for w, v in values if not math.isnan(v)]
        totals.append(sum(scored) if scored else math.nan)
    return totals, per_reward


def _call(reward: NamedReward, prompts: Sequence[Any], completions: Sequence[Any], fields: dict[str, list],
          where: Sequence[str]) -> list[float]:
    label = f"reward {reward.key} ({reward.name})"
    try:
        values = reward.fn(prompts=list(prompts), completions=list(completions), **fields)
    except Exception as exc:  # noqa: BLE001 - find the record it fails on: call it one record at a time
        bad = next((j for j in range(len(completions)) if _fails(reward, prompts, completions, fields, j)), 0)
        raise RewardError(f"{where[bad]}: {label} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(values, list | tuple) or len(values) != len(completions):
        shown = f"{len(values)} values" if isinstance(values, list | tuple) else f"a {type(values).__name__}"
        raise RewardError(f"{where[0]}: {label} returned {shown} for {len(completions)} completions; it must "
                          "return one number (or None) per completion")
    out = []
    for j, value in enumerate(values):
        if value is None:
            out.append(math.nan)
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out.append(float(value))
        else:
            raise RewardError(f"{where[j]}: {label} returned {value!r} for completion {j}, not a finite number "
                              "(return None when the reward does not apply)")
    return out


def _fails(reward: NamedReward, prompts: Sequence[Any], completions: Sequence[Any], fields: dict[str, list],
           j: int) -> bool:
    try:
        reward.fn(prompts=[prompts[j]], completions=[completions[j]], **{k: [v[j]] for k, v in fields.items()})
    except Exception:  # noqa: BLE001
        return True
    return False


def completion_text(completion: Any) -> str:
    """A completion's text: the string, or the content of the last message of a conversational completion."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    return str(completion)


def _answer(cfg: AnswerReward) -> RewardFn:
    regex = re.compile(cfg.pattern, re.DOTALL) if cfg.pattern is not None else \
        re.compile(rf"<{re.escape(cfg.tag or 'answer')}>(.*?)</{re.escape(cfg.tag or 'answer')}>", re.DOTALL)

    def answer(prompts: list, completions: list, **fields: list) -> list[float | None]:
        if cfg.field not in fields:
            raise KeyError(f"the records have no field {cfg.field!r} (fields: {', '.join(sorted(fields)) or 'none'})")
        out: list[float | None] = []
        for completion, truth in zip(completions, fields[cfg.field], strict=True):
            matches = list(regex.finditer(completion_text(completion)))
            if not matches:
                out.append(0.0)
                continue
            last = matches[-1]
            given = (last.group(1) if regex.groups else last.group(0)).strip()
            out.append(1.0 if _same(given, truth, cfg) else 0.0)
        return out

    return answer


def _same(given: str, truth: Any, cfg: AnswerReward) -> bool:
    if cfg.compare == "exact":
        return given == str(truth).strip()
    a, b = _number(given), _number(truth)
    return a is not None and b is not None and abs(a - b) <= cfg.tolerance


def _number(value: Any) -> float | None:
    """A number written as text (`1,024`, ` -3.5 `) or given as one; None when it is not a number."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    try:
        number = float(str(value).strip().replace(",", ""))
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _format(cfg: FormatReward) -> RewardFn:
    regex = re.compile(cfg.pattern, re.DOTALL)

    def format_match(prompts: list, completions: list, **fields: list) -> list[float]:
        return [1.0 if regex.search(completion_text(c)) else 0.0 for c in completions]

    return format_match


def _length(cfg: LengthReward) -> RewardFn:
    low, high = cfg.min_chars or 0, cfg.max_chars if cfg.max_chars is not None else math.inf

    def length(prompts: list, completions: list, **fields: list) -> list[float]:
        return [1.0 if low <= len(completion_text(c)) <= high else 0.0 for c in completions]

    return length


_BUILT_IN: dict[type, Callable[[Any], RewardFn]] = {AnswerReward: _answer, FormatReward: _format, LengthReward: _length}
