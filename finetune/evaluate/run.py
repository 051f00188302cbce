"""Evaluate runs on the user's held-out records, or on a run's own held-out split: loss and perplexity on the
tokens a run trains on (the assistant turns of chat records, all of a text record), and for records with an
expected answer the greedy generation scored by finetune.evaluate.match; for a preference run (dpo, orpo,
simpo, cpo), its chosen/rejected pairs instead (finetune.evaluate.pairs). The base model and every run are
measured on the same tokens."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from finetune.console import progress_bar
from finetune.data.build import (
    DataRead,
    build_datasets,
    built_fingerprint,
    check_records,
    data_kind,
    data_read,
    data_read_as,
    evaluable_split,
)
from finetune.data.fingerprint import DataChanged, data_changes
from finetune.data.formats import PREFERENCE_FORMATS, Chat, Example, RecordError, images_of, normalize
from finetune.data.read import Record
from finetune.errors import DataError, UsageError
from finetune.evaluate.match import KINDS, score
from finetune.evaluate.pairs import pair_measures
from finetune.model.chat import reply
from finetune.model.load import load_tokenizer
from finetune.model.trained import load_adapters, load_run, load_trained, loaded, reads_images, vision_of
from finetune.recipe.schema import DataConfig, Recipe
from finetune.rundir import RunDir, atomic_write_json, read_json
from finetune.step.preference import PreferenceLoss
from finetune.train.streamed_load import streamed_use

BASE = "base model"


ANSWER_MARGIN = 16  # new tokens past twice the longest expected answer, for a preamble ("The answer is ...")


def evaluate(run_dir: str | Path, data: str | Path | None = None, *, compare: list[str | Path] | None = None,
             max_new_tokens: int | None = None, progress: Callable[[str], None] = lambda line: None
             ) -> dict[str, Any]:
    """Measure the run (and, with `compare`, the base model and the runs listed, side by side) on the records of
    `data`, or (None) on the run's own held-out split: the records data.validation_split kept out of its
    training data, built by the same data build with the run's seed and tokenizer (refused, exit 2, where the
    run holds none out, or where that data changed since: its split would be other records). The result is
    also written to the run's evaluation.json (the caller holds the run's lock: finetune.api.evaluate). Each
    answer ends at the model's end of turn, or at `max_new_tokens` (None: twice the longest expected answer's
    tokens + ANSWER_MARGIN, `answer_cap`: enough for an answer to be matched, short of the minutes a model that
    never ends its turn would spend); the answers cut there are counted per model (`capped`). `progress` gets
    a line as each model's phase starts; the answers' progress is a bar on a terminal, else a line each tenth
    or 30 s (finetune.console.progress_bar). A preference run (dpo, orpo, simpo, cpo) is measured on pairs,
    its split's or the file's (`pair_measures`: no answers generated, `max_new_tokens` unused); a kto run's
    split is refused (its answers are unpaired)."""
    recipe, run = load_run(run_dir)
    runs = [*(compare or []), run_dir]
    cfg, method = _data_config(recipe, run_dir, data)
    # the file parses and its records have their fields (and readable images), and the run's split is of the
    # data it trained on: in seconds, before a model loads; read once, the fingerprint's reading and rendering
    # handed on to the build
    read = _read_data(cfg, method, data)
    method = read.method  # a preference run's --data file of conversations: sft records
    # a preference run's pairs: measured by its method's log-probabilities and loss (no answers generated)
    pairs = PreferenceLoss.of(recipe.training) if data_kind(method) == "pair" else None
    check_records(cfg, method, model_takes_images=reads_images(recipe), read=read)
    if data is None:
        tokenizer = load_tokenizer(run.adapter, recipe.model)  # the run's, as the models load it
        _check_unchanged(run, built_fingerprint(cfg, tokenizer, recipe.training.seed, method, reads_images(recipe),
                                                read=read))
    results: list[dict[str, Any]] = []
    answers: list[dict[str, Any]] = []
    examples = prompts = bundle = vision = None
    cap = max_new_tokens or 0
    records_read = 0
    for label, model, tokenizer in _models(runs, with_base=compare is not None):
        if examples is None:
            vision = vision_of(run_dir, model, tokenizer)  # a vision-language run: images as it trained on them
            # the run's split: its held-out part alone is tokenized
            bundle = build_datasets(cfg, tokenizer, recipe.training.seed, method, vision=vision, read=read,
                                    held_out_only=data is None)
            if data is None:
                if bundle.eval is None:  # as the run, which then had no evaluation either
                    raise DataError(f"finetune eval {run_dir}: none of the {len(bundle.held_out)} records "
                                    f"data.validation_split held out of {cfg.label()} is an example (each longer "
                                    f"than data.max_seq_len={cfg.max_seq_len} or without answer tokens)",
                                    hint="give held-out records with --data FILE")
                examples, records_read = bundle.eval, len(bundle.held_out)
                prompts = expected_answers(bundle.held_out) if pairs is None else []
            else:
                examples, records_read = bundle.train, bundle.stats["records"]
                prompts = expected_answers(_file_examples(read, cfg.system_prompt)) if pairs is None else []
            answers = [_answer_row(where, messages, expected) for where, messages, expected in prompts]
            cap = max_new_tokens or answer_cap(tokenizer, [expected for _, _, expected in prompts])
        if pairs is not None:  # held-out pairs: preference accuracy, margins, the chosen answers' NLL
            progress(f"{label}: preferences on {len(examples)} pairs")
            results.append({"label": label, **pair_measures(model, examples, bundle.collator, pairs,
                                                            is_base=label == BASE)})
            continue
        progress(f"{label}: loss on {len(examples)} examples")
        loss, tokens = held_out_loss(model, examples, bundle.collator)
        scores = {kind: [] for kind in KINDS}
        capped = 0
        if prompts:
            progress(f"{label}: answering {len(prompts)} records, at most {cap} new tokens each")
        with progress_bar(f"eval {label}: answers") as bar:
            task = bar.add_task("answers", total=len(prompts))
            for row, (_, messages, expected) in zip(answers, prompts, strict=True):
                text, cut = reply(model, tokenizer, messages, max_new_tokens=cap, vision=vision)
                row["answers"][label] = text
                capped += cut
                for kind, ok in score(text, expected).items():
                    if ok is not None:
                        scores[kind].append(ok)
                bar.update(task, advance=1)
        results.append({"label": label, "loss": loss, "perplexity": math.exp(loss), "loss_tokens": tokens,
                        **{kind: _rate(scores[kind]) for kind in KINDS}, "capped": capped})
    # records_read: the file's records, bad ones included (the split's: the records it held out); examples_kept:
    # those the loss is measured on (a bad record skipped by data.on_bad_record, one longer than max_seq_len
    # dropped or with no answer tokens is not)
    used = (str(Path(data).resolve()) if data is not None
            else f"held-out split of {cfg.label()} ({records_read} records)")
    if pairs is not None:  # no answers generated: what the pairs were measured by instead
        how = {"preference": {"method": method, "beta": pairs.beta,
                              "reference": "base model (adapters off)" if pairs.uses_reference else None}}
    else:
        how = {"with_expected_answer": len(answers), "max_new_tokens": cap,
               "max_new_tokens_from": "given" if max_new_tokens else "expected answers"}
    report = {"data": used, "records_read": records_read, "examples_kept": len(examples), **how,
              "models": results, **({"answers": answers} if pairs is None else {})}
    atomic_write_json(RunDir(run.root).evaluation, report)
    return report


def _data_config(recipe: Recipe, run_dir: str | Path, data: str | Path | None) -> tuple[DataConfig, str]:
    """(data config, training method) the evaluation builds its examples by: the file `data` read whole (for
    a dpo, orpo, simpo or cpo run its method, which `_read_data` keeps for a file of preference records and
    turns to sft for one of conversations; else as sft records), or (None) the run's own
    data as it trained on it, unpacked (packing joins examples into rows, and the split is made before it);
    UsageError where that is not there to measure."""
    method = recipe.training.method
    if data is not None:
        if not Path(data).is_file():
            raise UsageError(f"eval --data {data}: no such file", hint="give a file of held-out records "
                             "(.jsonl, .json, .csv or .parquet, in any training data format)")
        return recipe.data.model_copy(update={"path": str(data), "format": "auto", "validation_split": 0.0,
                                              "packing": False, "max_samples": None}), \
            method if data_kind(method) == "pair" else "sft"
    if not evaluable_split(recipe.data, method):
        kind = data_kind(method)
        why = ("holds no records out of its training data (data.validation_split is 0)"
               if recipe.data.validation_split == 0 else
               f"is a {method} run: its held-out records are "
               f"{'prompts' if kind == 'prompt' else 'answers labelled good or bad, not pairs'}, which eval does not "
               "measure")
        raise UsageError(f"finetune eval {run_dir}: the run {why}; give held-out records with --data FILE")
    return recipe.data.model_copy(update={"packing": False}), method


def _read_data(cfg: DataConfig, method: str, data: str | Path | None) -> DataRead:
    """`data_read`; the --data file of a preference run is read as pairs where it holds preference records,
    as sft records where it holds conversations (their loss and answers, as for an sft run), and its DataError
    says it was eval's file, and what a preference run's file holds (not how to train on it)."""
    try:
        if data is not None and data_kind(method) == "pair":
            return data_read_as(cfg, lambda fmt: method if fmt in PREFERENCE_FORMATS else "sft")
        return data_read(cfg, method)
    except DataError as exc:
        if data is None or data_kind(method) != "pair":
            raise
        raise DataError(f"eval --data: {exc.message}", problems=exc.problems,
                        hint=f"give records with prompt/chosen/rejected to measure a {method} run's preferences"
                        ) from None


def _check_unchanged(run: RunDir, now: dict[str, Any]) -> None:
    """The run's held-out split is made again only from the data it trained on: DataChanged (exit 2) where the
    data's fingerprint differs from the one the run saved (records, tokenizer, split settings). Packing is
    not compared: the evaluation builds unpacked, and packing does not decide which records are held out."""
    saved = read_json(run.data_fingerprint)
    if saved is None:
        raise DataChanged(f"finetune eval {run.root}: the run saved no data fingerprint ({run.data_fingerprint}), so "
                          "its held-out split cannot be told to be the same records; give held-out records with "
                          "--data FILE")
    saved = {**saved, "settings": {k: v for k, v in (saved.get("settings") or {}).items() if k != "data.packing"}}
    if changes := data_changes(saved, now):
        raise DataChanged(f"finetune eval {run.root}: the training data ({now['path']}) changed since the run "
                          f"trained on it ({'; '.join(changes)}), so its held-out split would be other records; "
                          "restore that data, or give held-out records with --data FILE")


def answer_cap(tokenizer: Any, expected: list[str]) -> int:
    """The default length limit of an answer: twice the longest expected answer's tokens + ANSWER_MARGIN."""
    text = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text tokenizer
    longest = max((len(text(e, add_special_tokens=False)["input_ids"]) for e in expected), default=0)
    return 2 * longest + ANSWER_MARGIN


def _rate(matches: list[bool]) -> dict[str, int] | None:
    return {"matched": sum(matches), "of": len(matches)} if matches else None


def _models(run_dirs: list[str | Path], *, with_base: bool) -> Iterator[tuple[str, Any, Any]]:
    """(label, model, tokenizer) in turn: the base model first (with_base), then each run, by folder name.
    LoRA runs share one loaded base with their adapters switched in turn; a full fine-tune loads alone."""
    recipes: list[Recipe] = [load_run(d)[0] for d in run_dirs]
    if all(r.adapter.type != "full" for r in recipes):
        with loaded(run_dirs[0], streamed_use,  # the base streamed as the first run's was
                    lambda arriving: load_adapters(run_dirs, arriving=arriving)) as (model, tokenizer, names):
            if with_base:
                with model.disable_adapter():
                    yield BASE, model, tokenizer
            for name, run_dir in zip(names, run_dirs, strict=True):
                model.set_adapter(name)
                yield Path(run_dir).name, model, tokenizer
        return
    if with_base:
        yield BASE, *load_trained(run_dirs[-1], use_adapter=False)
    for run_dir in run_dirs:
        yield Path(run_dir).name, *load_trained(run_dir)


def _answer_row(where: str, messages: list[dict[str, Any]], expected: str) -> dict[str, Any]:
    """evaluation.json's entry for one record: the last user turn's text, and the prompt's images where it
    has any (their paths); each model's answer is added under its label."""
    images = images_of(Chat(messages))
    return {"where": where, "prompt": _text(messages[-1]["content"]), "expected": expected, "answers": {},
            **({"images": images} if images else {})}


def _text(content: str | list[dict[str, str]]) -> str:
    """A turn's text: its content, or the text parts of a turn of an image record."""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def held_out_loss(model: Any, examples: Any, collate: Callable[[list[dict]], dict[str, Any]] | None = None
                  ) -> tuple[float, int]:
    """(mean cross-entropy per loss token, loss tokens) over tokenized examples (input_ids, labels); an example
    with images goes through `collate` (the data's collator), which adds the model's image inputs."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            if example.get("images") and collate is not None:
                inputs = {k: v.to(model.device) for k, v in collate([example]).items() if k != "labels"}
            else:
                inputs = {"input_ids": torch.tensor([example["input_ids"]], device=model.device)}
            labels = torch.tensor(example["labels"][1:], device=model.device)
            logits = model(**inputs).logits[0, :-1].float()
            total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    return total / max(count, 1), count


def expected_answers(examples: Iterable[tuple[Record, Example]]) -> list[tuple[str, list[dict], str]]:
    """(where, prompt messages, expected answer) for each chat record (as read, and normalised) that ends with
    an assistant turn after a user turn: the expected answer is the record's `expected` string where it has
    one (a short answer to look for, as "Paris"), else that last assistant turn."""
    out = []
    for record, example in examples:
        if not isinstance(example, Chat) or len(example.messages) < 2:
            continue
        *prompt, last = example.messages
        if last["role"] != "assistant" or prompt[-1]["role"] != "user":
            continue
        expected = record.value.get("expected") if isinstance(record.value, dict) else None
        out.append((record.where, prompt, expected if isinstance(expected, str) else _text(last["content"])))
    return out


def _file_examples(read: DataRead, system_prompt: str | None) -> Iterator[tuple[Record, Example]]:
    """Each well-formed record of the one file `read` (eval --data, as read once) with its normalised example."""
    (file,), (fmt,) = read.files, read.formats
    for record in file.read.records:
        try:
            yield record, normalize(record.value, fmt, system_prompt, Path(file.entry.path).parent)
        except RecordError:
            continue  # build_datasets already reported it (or skips it, as data.on_bad_record says)
