"""The planner's in-process memory: every cache the planner keeps between plans, owned by one `Planner`.

Why: a plan with every key on `auto` asks for the same traces, parameter tables and meta kernels hundreds of
times, so the planner remembers them; keeping that memory in one object (not in module globals and
`functools.lru_cache`s spread over trace.py and memory_model.py) lets a caller (a test, a long-lived UI
process, a benchmark comparing cold and warm plans) see and drop all of it with `clear()`. The disk cache
(`trace_cache`) is below this layer and stays: `clear()` drops what the process holds, not what is on disk.

`finetune.plan.predict(recipe)` plans with `DEFAULT`; `predict(recipe, planner=Planner())` with caches of its
own. The instance is passed down explicitly (`ModelSpec.planner`, the trace functions' `planner=`): this module
imports nothing of the planner's, so the planner's modules all import it and it imports none of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Bounded(dict):
    """A dict that keeps its `limit` most recently used entries (what `functools.lru_cache(limit)` kept)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.lock = threading.Lock()

    def get_or_compute(self, key: Any, compute: Callable[[], T]) -> T:
        """The value of `key`, computed (outside the lock: a trace takes seconds) where it is not held."""
        with self.lock:
            if key in self:
                value = self[key] = self.pop(key)  # most recent last
                return value
        value = compute()
        with self.lock:
            self[key] = value
            while len(self) > self.limit:
                del self[next(iter(self))]
        return value


class Planner:
    """The planner's caches: what `finetune.plan.predict(recipe, planner=...)` remembers between plans; `clear`
    forgets everything it remembered."""

    MEMO_LIMIT = 200_000  # meta kernels' outputs remembered before the memo starts over
    MODELS_KEPT = 16  # meta models kept for the next trace, by what shapes them

    def __init__(self) -> None:
        self.traces: Bounded = Bounded(512)  # trace_step: one forward+backward's memory windows
        self.params: Bounded = Bounded(512)  # param_table_of: a cut model's parameters
        self.param_sums: Bounded = Bounded(4096)  # memory_model: weights, state, gradients of a cut model
        self.images: Bounded = Bounded(16)  # search.planned_example: each image record's sizes and text bound, by data files
        self.data: Bounded = Bounded(16)  # plan.data.read_data: the data's shape (or why none), by data and files
        self.meta_kernels: dict[tuple, Any] = {}  # (op, inputs' metadata) -> outputs' metadata (None: not memoisable)
        self.functional: dict[Any, bool] = {}  # op -> its schema neither mutates nor aliases an argument
        self.models: dict[tuple, list[Any]] = {}  # meta models built for tracing, free for the next trace
        self.models_lock = threading.Lock()
        self.config_keys: dict[int, tuple[Any, tuple[str, str]]] = {}  # id(config) -> (weakref, its key)
        self.config_keys_lock = threading.Lock()

    def held(self) -> int:
        """How many entries the caches hold (0 after `clear`)."""
        return sum(map(len, (self.traces, self.params, self.param_sums, self.images, self.data, self.meta_kernels,
                             self.functional, self.models, self.config_keys)))

    def clear(self) -> None:
        """Forget every trace, table, kernel memo and model held; the next plan traces again (or reads the
        disk cache)."""
        for store in (self.traces, self.params, self.param_sums, self.images, self.data):
            with store.lock:
                store.clear()
        self.meta_kernels.clear()
        self.functional.clear()
        with self.models_lock:
            self.models.clear()
        with self.config_keys_lock:
            self.config_keys.clear()


DEFAULT = Planner()
