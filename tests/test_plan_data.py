"""The plan is made for the data the user has: the largest micro-batch the run forms from its examples, with
data.max_seq_len only as the cap; a note where the data cannot be read before the plan; and where nothing fits,
the settings the recipe fixes that would make it fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune import api
from finetune.cli import main
from finetune.data.batching import epoch_order
from finetune.data.build import build_datasets, data_shape
from finetune.data.shape import DataShape
from finetune.plan import Planner, predict
from finetune.recipe.load import validate_recipe
from tests.run_support import text_data, tiny_lora_recipe

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
LENGTHS = [5, 17, 40, 23, 9, 31, 12, 28]


def _recipe(tmp_path: Path, model: Path, data: Path, max_seq_len: int, **training):
    return validate_recipe(tiny_lora_recipe(model, data, tmp_path / "run", {
        "data": {"max_seq_len": max_seq_len, "format": "text", "overlong": "truncate"},
        "training": {"micro_batch_size": 2, "max_steps": 2, **training}}))


def _largest_micro_batch(recipe, tokenizer, steps: int) -> tuple[int, int]:
    """The largest micro-batch (rows, row length) the run's collator makes of the data in its first `steps`
    steps, in the loop's order (its permutation, cut in micro-batches of the recipe's size)."""
    bundle = build_datasets(recipe.data, tokenizer, recipe.training.seed)
    rows, seed = recipe.training.micro_batch_size, recipe.training.seed
    batches = []
    for epoch in range(-(-steps * rows // len(bundle.train))):
        order = epoch_order(len(bundle.train), seed, epoch)
        batches += [order[i:i + rows] for i in range(0, len(order), rows)]
    shapes = [tuple(bundle.collator([bundle.train[j] for j in b])["input_ids"].shape) for b in batches[:steps]]
    return max(shapes, key=lambda s: (s[1], s[0]))


@pytest.mark.parametrize("max_seq_len", [256, 32], ids=["shorter-than-max_seq_len", "capped"])
def test_the_plan_is_made_for_the_longest_micro_batch_the_run_forms(tmp_path, tiny_model_dir, tiny_tokenizer,
                                                                     max_seq_len):
    """The traced rows are as long as the longest real micro-batch (over two epochs: the longest example, capped
    at max_seq_len), and that plan is lower than the plan for max_seq_len-token rows wherever the data is
    shorter. Two steps see only their own micro-batches: the plan prices the longest of those."""
    recipe = _recipe(tmp_path, tiny_model_dir, text_data(tmp_path / "d.jsonl", LENGTHS), max_seq_len,
                     max_steps=None, epochs=2)
    plan = predict(recipe, device="cpu", planner=Planner())
    rows, longest = _largest_micro_batch(recipe, tiny_tokenizer, steps=len(LENGTHS))
    assert rows == 2 and plan.data["sequence"] == longest == min(max(LENGTHS) + 1, max_seq_len)  # text ends in EOS
    assert plan.data["examples"] == len(LENGTHS) and plan.data["rows"] == 2 and plan.notes == []
    bound = predict(recipe, device="cpu", planner=Planner(), full_length=True)  # max_seq_len-token rows
    assert bound.data == {}
    if longest < max_seq_len:
        assert plan.peak_bytes < 0.8 * bound.peak_bytes
        assert plan.planned_for() == f"for the run's largest micro-batch (2 x {longest} tokens; data.max_seq_len 256)"
    else:
        assert plan.peak_bytes == bound.peak_bytes
    two = _recipe(tmp_path, tiny_model_dir, text_data(tmp_path / "d.jsonl", LENGTHS), max_seq_len)  # max_steps 2
    assert predict(two, device="cpu", planner=Planner()).data["sequence"] == _largest_micro_batch(two, tiny_tokenizer, 2)[1]


def test_without_a_tokenizer_the_plan_keeps_max_seq_len_and_says_why(tmp_path):
    """`finetune plan` with only a config.json: the data cannot be tokenized, so the plan is today's bound (rows
    of max_seq_len) with a note naming why, in the plan and on the console."""
    recipe = validate_recipe({"model": {"path": str(CONFIGS / "qwen2.5-0.5b.json")},
                              "data": {"path": str(ROOT / "recipes" / "data" / "quickstart.jsonl"), "max_seq_len": 512},
                              "training": {"micro_batch_size": 1}, "output": {"dir": str(tmp_path / "run")}})
    plan = api.plan(recipe, gpu_memory="16GiB")
    assert plan.data == {}
    note = next(n for n in plan.notes if n.startswith("planned for data.max_seq_len 512 (an upper bound)"))
    assert "not tokenized before the plan" in note and "qwen2.5-0.5b.json" in note
    assert plan.peak_bytes == predict(recipe, gpu_memory="16GiB", device="cuda", full_length=True).peak_bytes


def test_unreadable_data_keeps_max_seq_len_with_a_note(tmp_path, tiny_model_dir):
    """Data the build would refuse (a malformed record under on_bad_record: error): the plan still comes, for
    max_seq_len, and its note says the data could not be read."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"oops": 1}\n')
    recipe = _recipe(tmp_path, tiny_model_dir, data, 64)
    plan = predict(recipe, device="cpu", planner=Planner())
    assert plan.data == {}
    assert any(n.startswith("planned for data.max_seq_len 64 (an upper bound): the data could not be read")
               for n in plan.notes), plan.notes


def test_the_data_shape_is_cached_under_the_data_fingerprint(tmp_path, tiny_model_dir, tiny_tokenizer):
    """The shape is measured once per data, tokenizer and data keys: the cache holds it, a change of max_seq_len
    is another entry, and an edited record another."""
    data = text_data(tmp_path / "d.jsonl", LENGTHS)
    recipe = _recipe(tmp_path, tiny_model_dir, data, 256)
    cache = tmp_path / "shapes"
    shape = data_shape(recipe.data, tiny_tokenizer, 42, cache=cache)
    assert shape == DataShape.from_json(next(cache.iterdir()).read_text())
    assert sorted(shape.lengths) == sorted(n + 1 for n in LENGTHS) and shape.histogram([16, 32]) == [3, 4, 1]
    assert data_shape(recipe.data, tiny_tokenizer, 42, cache=cache) == shape and len(list(cache.iterdir())) == 1
    capped = _recipe(tmp_path, tiny_model_dir, data, 16)
    assert data_shape(capped.data, tiny_tokenizer, 42, cache=cache).longest == 16
    data.write_text(data.read_text().replace("fox", "cat", 1))
    data_shape(recipe.data, tiny_tokenizer, 42, cache=cache)
    assert len(list(cache.iterdir())) == 3


QWEN3_MOE = ["recipes/qlora-qwen3-30b-a3b-24gb.yaml", "--set", f"model.path={CONFIGS / 'qwen3-30b-a3b.json'}",
             "--gpu-memory", "12GiB"]


def test_the_shipped_moe_recipe_fits_12_gib(capsys):
    """Qwen3-30B-A3B with the shipped 24 GB recipe on a 12 GiB card: its experts are the planner's to offload."""
    assert main(["plan", *QWEN3_MOE]) == 0
    assert "Plan for cuda: fits" in capsys.readouterr().out


def test_nothing_fits_names_the_setting_that_would_fit_with_its_peak_and_speed(capsys):
    """The same recipe with the experts pinned to the GPU: nothing fits 12 GiB, and the message names
    memory.offload_experts: auto with the peak and speed of the plan it gives, within the budget."""
    assert main(["plan", *QWEN3_MOE, "--set", "memory.offload_experts=none"]) == 1
    out = capsys.readouterr().out
    assert "Nothing fits." in out
    recipe = api.load_recipe(QWEN3_MOE[0], [QWEN3_MOE[2], "memory.offload_experts=none"])
    plan = api.plan(recipe, gpu_memory="12GiB")
    fix = next(f for f in plan.fixes if f["key"] == "memory.offload_experts")
    assert fix["value"] in ("cpu", "disk") and fix["peak_bytes"] <= plan.budget_bytes and fix["tokens_per_s"] > 0
    assert plan.fix_lines()[plan.fixes.index(fix)] in " ".join(out.split())  # the console wraps long lines


@pytest.mark.parametrize(("lengths", "rows", "padded"), [
    ([200, 210, 220, 230, 20, 30, 40, 50], 4, False),  # four records cut to max_seq_len share a micro-batch
    ([10, 12, 14, 16, 100, 110], 2, True),  # six records, one step of 8: micro-batches of 4 and 2 rows
], ids=["unpadded", "fewer-rows"])
def test_a_grouped_run_is_planned_at_its_largest_real_micro_batch(tmp_path, tiny_model_dir, lengths, rows, padded):
    """data.batching length_grouped: the plan prices the largest micro-batch the run forms (from the loop's own
    permutation), not micro_batch_size rows at the longest example, padded: one whose rows are all cut to
    max_seq_len has no padding (no attention mask is built), and the two longest of six records share the
    step's 2-row micro-batch. The run's measured peak is within 5% of that plan, and below the bound's."""
    data = text_data(tmp_path / "d.jsonl", lengths)

    def recipe(batching: str):
        return validate_recipe(tiny_lora_recipe(tiny_model_dir, data, tmp_path / "run", {
            "data": {"max_seq_len": 128, "format": "text", "overlong": "truncate", "batching": batching},
            "training": {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "seed": 0}}))

    api.run(recipe("length_grouped"), overwrite=True)
    files = api.view_of(tmp_path / "run")
    memory = api.run_memory(files)
    planned, measured = memory["planned_peak_bytes"], memory["measured_peak_bytes"]
    assert (files.plan["data"]["rows"], files.plan["data"]["padded"]) == (rows, int(padded))
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)
    at_random = predict(recipe("random"), device="cpu", planner=Planner())  # 4 padded rows at the longest
    assert at_random.data["rows"] == 4 and at_random.data["padded"] == 1
    assert measured < 0.95 * at_random.peak_bytes


def test_a_fixed_recipe_fits_at_the_price_of_its_runs_micro_batches(tmp_path, tiny_model_dir):
    """Every setting fixed, data.batching length_grouped: nothing to search, so the fit verdict is the price of
    the micro-batches the run forms (2 padded rows at the longest example), not the bound over every batching
    (4 rows there), which once refused a budget the run fits: accepted between the two with that price as its
    peak, refused one byte below it (the least budget it names is that price)."""
    data = text_data(tmp_path / "d.jsonl", [10, 12, 14, 16, 100, 110])

    def recipe(**training):
        return validate_recipe(tiny_lora_recipe(tiny_model_dir, data, tmp_path / "run", {
            "data": {"max_seq_len": 128, "format": "text", "batching": "length_grouped"},
            "training": {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "seed": 0, **training},
            "memory": {"gpu_memory_margin": 0}}))

    exact = api.plan(recipe(), device="cpu", gpu_memory="64GiB")
    assert exact.fits and (exact.data["rows"], exact.data["padded"]) == (2, 1) and not exact.alternatives
    bound = api.plan(recipe(epochs=17), device="cpu", gpu_memory="64GiB")  # more epochs than are cut: the bound
    assert "rows" not in bound.data and bound.peak_bytes > 1.2 * exact.peak_bytes
    between = api.plan(recipe(), device="cpu", gpu_memory=(exact.peak_bytes + bound.peak_bytes) // 2)
    assert between.budget_bytes < bound.peak_bytes
    assert between.fits and between.peak_bytes == exact.peak_bytes and between.data["rows"] == 2
    below = api.plan(recipe(), device="cpu", gpu_memory=exact.peak_bytes - 1)
    assert not below.fits and below.min_budget_bytes == exact.peak_bytes
