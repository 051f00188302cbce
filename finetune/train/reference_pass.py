"""training.precompute_reference: the reference model's log-probabilities of the training and eval data,
computed once before training, so no step runs a reference forward (`finetune.step.preference`).

The pass runs before the training loop exists (no optimizer state, no gradients), under no_grad, one micro-batch
at a time. A run started from an adapter (adapter.init_from) runs it on the model as it is: before the first
step its trained adapter holds the start weights, so no frozen copy of them is loaded (nor kept through
training, nor priced by the planner). Its values join the datasets as a `ref_logps` column that the collator
turns into the batch's `ref_logps`. They are kept in the run directory: `--resume` reads them back instead of
paying the pass again, and trains on the very values the interrupted run used. The file names a fingerprint
of what the values depend on (the tokenized data, the model, quantization, adapter and start weights, chunked
loss); when it does not match (other data, another model, a retrained start adapter), the values are computed
again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from finetune.console import console, progress_bar
from finetune.data.build import DataBundle
from finetune.recipe.init_from import init_from_record
from finetune.recipe.schema import Recipe
from finetune.rundir import RunDir, atomic_write_text, read_json
from finetune.step.preference import PreferenceLoss, reference_is_current, reference_values

FORMAT = 1  # of the file; a different one is computed again


def fingerprint(recipe: Recipe, data: DataBundle) -> str:
    """What the reference values depend on: the model, how it is loaded and adapted (with adapter.init_from,
    the start weights' sha256: a parent run trained again keeps its path), the loss's chunking, and every
    token and label of the training and eval data (a sha256)."""
    start = init_from_record(recipe.adapter.init_from)["sha256"] if recipe.adapter.init_from else None
    digest = hashlib.sha256()
    digest.update(json.dumps([FORMAT, recipe.model.model_dump(mode="json"),
                              recipe.quantization.model_dump(mode="json"), recipe.adapter.model_dump(mode="json"),
                              start, recipe.memory.chunked_loss is True, recipe.training.method],
                             sort_keys=True).encode())
    for split in (data.train, data.eval):
        digest.update(b"|split|")
        if split is None:
            continue
        columns = sorted(c for c in split.column_names if c != "ref_logps")
        for batch in split.select_columns(columns).iter(batch_size=1024):
            digest.update(json.dumps([batch[c] for c in columns]).encode())
    return digest.hexdigest()


def compute_reference(model: torch.nn.Module, dataset: Any, collator: Callable[[list], dict], loss: PreferenceLoss,
                      micro_batch: int, chunked: bool = False,
                      autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                      progress: Callable[[int], None] | None = None,
                      current: bool = False) -> list[list[float]]:
    """The reference values of every example of `dataset` (collated as training collates it, `micro_batch`
    examples at a time), in its order; `progress` is told how many examples each batch did. `current`: the
    reference is the model as it is (`finetune.step.preference.reference_logps`)."""
    device = next(model.parameters()).device
    values: list[list[float]] = []
    for start in range(0, len(dataset), micro_batch):
        rows = [dataset[i] for i in range(start, min(start + micro_batch, len(dataset)))]
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in collator(rows).items()}
        with autocast():
            values += reference_values(model, batch, loss, chunked, current)
        if progress is not None:
            progress(len(rows))
    return values


def attach_reference(model: torch.nn.Module, data: DataBundle, recipe: Recipe, run_dir: RunDir,
                     autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                     should_stop: Callable[[], bool] = lambda: False) -> DataBundle:
    """The datasets with their `ref_logps` column: read from the run directory when it holds the values of
    this data and model, else computed (with a progress bar) and written there atomically. `should_stop`
    (a Ctrl-C) is asked after each batch: the pass then stops with KeyboardInterrupt, nothing written.
    Call it before the first training step: with adapter.init_from the model's adapter is the reference."""
    loss = PreferenceLoss.of(recipe.training)
    key = fingerprint(recipe, data)
    stored = read_json(run_dir.reference_logps)
    splits = {"train": data.train, "eval": data.eval}
    if stored is not None and stored.get("fingerprint") == key and all(
            isinstance(stored.get(name), list) and len(stored[name]) == (len(ds) if ds is not None else 0)
            for name, ds in splits.items()):  # a damaged or edited file is computed again
        values = stored
        console.print(f"reference log-probabilities: read from {run_dir.reference_logps}")
        run_dir.log_line("reference pass: values read from the run directory")
    else:
        values = {"fingerprint": key}
        total = sum(len(ds) for ds in splits.values() if ds is not None)
        start = time.time()
        console.print(f"reference pass: {total:,} examples, the reference model's log-probabilities computed once "
                      "before training", markup=False, highlight=False)
        with progress_bar("reference pass") as bar:
            task = bar.add_task("reference", total=total)

            def advance(n: int) -> None:
                bar.update(task, advance=n)
                if should_stop():
                    console.print("[yellow]stopped during the reference pass: nothing saved, the next run "
                                  "computes it again[/yellow]")
                    raise KeyboardInterrupt

            for name, ds in splits.items():
                values[name] = [] if ds is None else compute_reference(
                    model, ds, data.collator, loss, int(recipe.training.micro_batch_size),
                    recipe.memory.chunked_loss is True or recipe.memory.kernels == "liger", autocast, advance,
                    current=reference_is_current(recipe))
        atomic_write_text(run_dir.reference_logps, json.dumps(values, separators=(",", ":")) + "\n")
        run_dir.log_line(f"reference pass: {total} examples in {time.time() - start:.1f} s, "
                         f"saved to {run_dir.reference_logps.name}")
    train = data.train.add_column("ref_logps", values["train"])
    evaluation = data.eval.add_column("ref_logps", values["eval"]) if data.eval is not None else None
    return dataclasses.replace(data, train=train, eval=evaluation)
