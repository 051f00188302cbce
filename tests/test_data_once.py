"""A command reads and tokenizes the user's data once: `finetune run`'s plan measures the examples its build then
trains on (finetune.data.build.DataRead, handed from the plan to the build), and the results are those of a
build made apart (the same examples in the same order, the same split, stats and fingerprint; the same plan and
losses). Counted through the data pipeline's own seams: `finetune.data.chat.tokenize_prefixes` (every text the
build tokenizes) and `finetune.data.build.read_files` (every read of the data files)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import finetune.data.build as build
import finetune.data.chat as chat
import finetune.plan.data as plan_data
import finetune.train.run as train_run
from finetune import api
from finetune.data.build import build_datasets, data_read, data_shape
from finetune.plan import DEFAULT_PLANNER, predict
from finetune.plan.search import data_for_run
from finetune.recipe.load import validate_recipe
from finetune.recipe.schema import DataConfig
from finetune.rundir import read_jsonl
from tests.run_support import sums_data, text_data, tiny_lora_recipe
from tests.test_vision_data import picture, record, write


class Counts:
    """Spies on the pipeline's seams: texts tokenized, data files read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.texts = self.reads = 0
        tokenize, read = chat.tokenize_prefixes, build.read_files

        def tokenize_prefixes(tokenizer, texts, max_tokens, **kwargs):
            self.texts += len(texts)
            return tokenize(tokenizer, texts, max_tokens, **kwargs)

        def read_files(cfg):
            self.reads += 1
            return read(cfg)

        monkeypatch.setattr(chat, "tokenize_prefixes", tokenize_prefixes)
        monkeypatch.setattr(build, "read_files", read_files)


def _same(a, b) -> None:
    """Two bundles of the same examples: every column of both parts, the counts, fingerprint, held-out records."""
    assert a.train.to_dict() == b.train.to_dict()
    assert (a.eval.to_dict() if a.eval is not None else None) == (b.eval.to_dict() if b.eval is not None else None)
    assert (a.stats, a.fingerprint, a.warnings, a.held_out) == (b.stats, b.fingerprint, b.warnings, b.held_out)


def _pairs(path: Path, n: int) -> Path:
    rows = [{"prompt": f"What is {i} plus {i}?", "chosen": f"It is {2 * i}.", "rejected": f"It is {i}." + " no" * (i % 3)}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("case", ["chat", "text", "dpo", "kto-of-pairs"])
def test_the_plans_read_is_built_without_tokenizing_again(tmp_path, tiny_tokenizer, monkeypatch, case):
    """The plan's measuring (data_shape) and the build over one DataRead tokenize what a build made apart does,
    once (each record, and each prompt cut to fit max_seq_len), and the bundle is that build's, whatever the data
    kind (held-out split included)."""
    method = {"dpo": "dpo", "kto-of-pairs": "kto"}.get(case, "sft")
    path = (text_data(tmp_path / "d.jsonl", [5, 40, 12, 23, 9, 31, 17, 28]) if case == "text" else
            _pairs(tmp_path / "d.jsonl", 8) if method != "sft" else sums_data(tmp_path / "d.jsonl", 8))
    # records longer than max_seq_len: text cut at its end, chats with their prompts cut
    cfg = DataConfig(path=str(path), max_seq_len=32, overlong="truncate", validation_split=0.25)
    counts = Counts(monkeypatch)
    apart = build_datasets(cfg, tiny_tokenizer, 3, method)
    assert apart.stats["truncated"] > 0 and (case == "text" or apart.stats["prompts_cut"] > 0)
    once = counts.texts
    counts.texts = counts.reads = 0
    read = data_read(cfg, method)
    shape = data_shape(cfg, tiny_tokenizer, 3, method, read=read)
    planned = counts.texts
    assert planned > 0  # the plan tokenized the training part
    # the run's data config after the plan (data.batching and max_pixels chosen) builds the plan's examples
    bundle = build_datasets(cfg.model_copy(update={"batching": "length_grouped"}), tiny_tokenizer, 3, method,
                            read=read)
    assert counts.texts == once and counts.reads == 1
    _same(bundle, apart)
    assert shape == data_shape(cfg, tiny_tokenizer, 3, method)


def test_a_read_is_not_taken_over_where_its_examples_would_differ(tmp_path, tiny_tokenizer, tiny_model_dir,
                                                                 monkeypatch):
    """Another seed or another tokenizer definition builds its own examples (the same as built apart); the
    files, read once, are read again only for another data config."""
    from transformers import AutoTokenizer

    cfg = DataConfig(path=str(sums_data(tmp_path / "d.jsonl", 8)), validation_split=0.25)
    other = AutoTokenizer.from_pretrained(tiny_model_dir)
    other.add_tokens(["<extra>"])
    counts = Counts(monkeypatch)
    read = data_read(cfg)
    build_datasets(cfg, tiny_tokenizer, 3, read=read)
    assert counts.texts == 8
    _same(build_datasets(cfg, tiny_tokenizer, 4, read=read), build_datasets(cfg, tiny_tokenizer, 4))
    _same(build_datasets(cfg, other, 3, read=read), build_datasets(cfg, other, 3))
    assert counts.texts == 8 * 5 and counts.reads == 1 + 2  # each build apart reads its files
    longer = cfg.model_copy(update={"max_seq_len": 48})
    _same(build_datasets(longer, tiny_tokenizer, 3, read=read), build_datasets(longer, tiny_tokenizer, 3))
    assert counts.reads == 3 + 2


def test_the_held_out_part_alone_is_the_full_builds(tmp_path, tiny_tokenizer, monkeypatch):
    """finetune eval of a run's split builds the held-out part alone: the same examples, held-out records and
    fingerprint as the whole build, without tokenizing the training part."""
    cfg = DataConfig(path=str(sums_data(tmp_path / "d.jsonl", 16)), validation_split=0.25)
    full = build_datasets(cfg, tiny_tokenizer, 3)
    counts = Counts(monkeypatch)
    alone = build_datasets(cfg, tiny_tokenizer, 3, held_out_only=True)
    assert counts.texts == full.stats["eval_examples"] == 4 and len(alone.train) == 0
    assert alone.eval.to_dict() == full.eval.to_dict()
    assert (alone.held_out, alone.fingerprint) == (full.held_out, full.fingerprint)


def test_image_records_are_tokenized_once_and_expanded_by_the_build(tmp_path, monkeypatch):
    """A vision-language model's data: the plan measures the text tokens and image sizes at no pixel budget, the
    build expands each image at the one the plan chose, from the same tokens; text records among them (one
    longer than max_seq_len, cut) are the build's as before."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.model.vision import vision_data
    from finetune.testing import vision_model

    folder = vision_model("qwen2_5_vl", tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    long = {"role": "user", "content": "Tell me. " * 40}
    records = [record([str(picture(tmp_path / f"{i}.png", (40 + 8 * i, 30)))]) for i in range(5)] + \
        [{"messages": [long, {"role": "assistant", "content": "No."}]},
         {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    cfg = DataConfig(path=str(write(tmp_path / "d.json", records)), max_seq_len=96, overlong="truncate",
                     validation_split=0.3)
    chosen = cfg.model_copy(update={"max_pixels": 64 * 28 * 28})
    vision = vision_data(AutoConfig.from_pretrained(folder), folder, tokenizer, chosen.max_pixels)
    apart = build_datasets(chosen, tokenizer, 0, vision=vision)
    counts = Counts(monkeypatch)
    read = data_read(cfg)
    shape = data_shape(cfg, tokenizer, 0, model_takes_images=True, read=read)
    bundle = build_datasets(chosen, tokenizer, 0, vision=vision, read=read)
    assert shape.has_images and bundle.stats["prompts_cut"] == bundle.stats["truncated"] == 1
    # each record once, and the prompt cut to fit max_seq_len once more, cut
    assert counts.texts == len(records) + 1 and counts.reads == 1
    assert bundle.stats["image_records"] == 5
    _same(bundle, apart)



def test_the_shape_lists_text_and_image_records_in_the_runs_order(tmp_path):
    """Text records among image records: the plan's shape keeps the build's order (the planner pairs examples
    into micro-batches as the run will), with each text example's fitted length, a dropped one left out."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.model.vision import vision_data
    from finetune.testing import vision_model

    folder = vision_model("qwen2_5_vl", tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "Hi " * 3}, {"role": "assistant", "content": "Hello there."}]
    records = []
    for i in range(6):
        records.append(record([str(picture(tmp_path / f"{i}.png", (40 + 8 * i, 30)))]))
        records.append({"messages": [{**chat[0], "content": "Hi " * (2 + 9 * i)}, chat[1]]})
    records.append({"messages": [{"role": "user", "content": "No answer."}]})  # dropped: nothing to train on
    cfg = DataConfig(path=str(write(tmp_path / "d.json", records)), max_seq_len=40, overlong="truncate",
                     validation_split=0.25, on_bad_record="skip")
    shape = data_shape(cfg, tokenizer, 1, model_takes_images=True)
    vision = vision_data(AutoConfig.from_pretrained(folder), folder, tokenizer, 64 * 28 * 28)
    train = build_datasets(cfg.model_copy(update={"max_pixels": 64 * 28 * 28}), tokenizer, 1, vision=vision).train
    assert [bool(sizes) for sizes in shape.images] == [bool(e.get("images")) for e in train]
    assert len({bool(sizes) for sizes in shape.images[:4]}) == 2, "the split keeps the two kinds interleaved"
    assert [n for n, sizes in zip(shape.lengths, shape.images, strict=True) if not sizes] == \
        [len(e["input_ids"]) for e in train if not e.get("images")]

def test_the_plan_and_a_replan_of_the_chosen_settings_read_the_data_once(
        tmp_path, tiny_model_dir, monkeypatch):
    """The planner remembers the data's shape whatever data.batching and data.max_pixels are (the plan chooses
    them; the shape does not depend on them): after the run's read (data_for_run), its plan and an out-of-memory
    re-plan of the chosen settings read nothing again."""
    recipe = validate_recipe(tiny_lora_recipe(tiny_model_dir, sums_data(tmp_path / "d.jsonl", 8), tmp_path / "run",
                                              {"data": {"batching": "auto"}, "training": {"max_steps": 2}}))
    monkeypatch.setattr(plan_data, "cache_dir", lambda: tmp_path / "cache")  # nothing measured before
    DEFAULT_PLANNER.data.clear()
    predict(recipe.model_copy(update={"training": recipe.training.model_copy(update={"seed": 7})}), device="cpu")
    counts = Counts(monkeypatch)
    planned = data_for_run(recipe)
    assert planned.read is not None and planned.shape is not None and counts.reads == 1
    plan = predict(recipe, device="cpu")
    replanned = predict(plan.apply(recipe).recipe, device="cpu", training_only=True)
    assert counts.reads == 1 and counts.texts == len(planned.shape.lengths)
    # the cache keeps no records (a plan's, and the run's read), only shapes
    assert len(DEFAULT_PLANNER.data) == 2 and all(entry.read is None for entry in DEFAULT_PLANNER.data.values())
    assert replanned.data == plan.data


def _run(tmp_path: Path, model: Path, data: Path, name: str) -> Path:
    recipe = validate_recipe(tiny_lora_recipe(model, data, tmp_path / name, {
        "data": {"validation_split": 0.25},
        "training": {"max_steps": 3, "micro_batch_size": 2, "learning_rate": 1e-2, "logging_steps": 1}}))
    DEFAULT_PLANNER.data.clear()
    api.run(recipe)
    return tmp_path / name


def test_finetune_run_tokenizes_its_data_once_and_trains_as_when_it_read_it_twice(tmp_path, tiny_model_dir,
                                                                                 monkeypatch):
    """The run's plan and build share one read: 16 records tokenized once (12 train, 4 held out), against 28
    with the plan's read not handed on (the plan's 12, the build's 16); the plan, the losses, the held-out
    loss, the data's counts and fingerprint are the same."""
    data = sums_data(tmp_path / "sums.jsonl", 16)
    monkeypatch.setattr(plan_data, "cache_dir", lambda: tmp_path / "cache")
    counts = Counts(monkeypatch)
    with monkeypatch.context() as apart:
        apart.setattr(train_run, "data_for_run", lambda recipe: replace(data_for_run(recipe), read=None))
        before = _run(tmp_path, tiny_model_dir, data, "apart")
    assert counts.texts == 12 + 16
    (tmp_path / "cache").rename(tmp_path / "cache-apart")  # the second run measures its data again
    counts.texts = counts.reads = 0
    after = _run(tmp_path, tiny_model_dir, data, "once")
    assert counts.texts == 16
    assert counts.reads == 2  # the preflight's check (no tokenizer), then the plan's, which the build takes over
    for name in ("data_stats.json", "data_fingerprint.json"):
        assert (after / name).read_text() == (before / name).read_text()

    def plan(run: Path) -> dict:  # the budget: this machine's free memory as each run began
        return {k: v for k, v in json.loads((run / "plan.json").read_text()).items() if k != "budget_bytes"}

    assert plan(after) == plan(before)

    def losses(run: Path) -> list:
        return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_jsonl(run / "metrics.jsonl")
                if "loss" in r or "eval_loss" in r]

    assert losses(after) == losses(before) and any(e is not None for _, _, e in losses(after))
