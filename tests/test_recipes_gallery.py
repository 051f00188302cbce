"""The ready recipes in recipes/ validate and fit the GPU they are written for; the API the UI's gallery,
basic form and Memory tab use (goals, GPU-size sweep, speed estimate) works without the UI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from finetune import api
from finetune.recipe.goals import GOALS
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import auto_keys

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
# Hub ids of the recipes -> the config fixture with the same shapes (tests are offline).
HUB_CONFIGS = {"meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b.json", "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b.json",
               "Qwen/Qwen3-8B": "qwen3-8b.json"}
HUB_CONFIGS.update({"Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b.json", "openai/gpt-oss-20b": "gpt-oss-20b.json",
                    "Qwen/Qwen2.5-VL-3B-Instruct": "qwen2.5-vl-3b.json", "Qwen/Qwen3-VL-8B-Instruct": "qwen3-vl-8b.json"})
GIB = 1 << 30


def _offline(recipe: Recipe) -> Recipe:
    """The recipe with a hub id replaced by the matching config fixture (the quickstart's GGUF is installed)."""
    path = recipe.model.path
    if path in HUB_CONFIGS:
        recipe.model.path = str(CONFIGS / HUB_CONFIGS[path])
    return recipe


def _gpu_gib(title: str) -> int | None:
    """The GPU size a recipe's title is written for ("... with a 16 GB GPU"), None when it names none."""
    found = re.search(r"(\d+) GB GPU", title)
    return int(found.group(1)) if found else None


GALLERY = api.recipe_gallery(ROOT / "recipes")


def test_the_gallery_lists_every_recipe_with_a_title():
    names = {r["name"] for r in GALLERY}
    assert {"quickstart", "qlora-8b-24gb", "qlora-8b-16gb", "qlora-8b-8gb", "long-context-8b",
            "full-finetune-small", "qwen3-8b-qlora-8gb", "qwen3-8b-qlora-16gb", "qwen3-8b-qlora-24gb"} <= names
    for entry in GALLERY:
        assert entry["title"] and entry["title"] != entry["name"], entry  # its first comment line
        assert len(entry["title"]) <= 32, entry["title"]  # a label that fits the gallery's list
        assert entry["description"] and not re.search(r"\bissue #?\d", entry["title"] + entry["description"])


@pytest.mark.parametrize("entry", GALLERY, ids=[r["name"] for r in GALLERY])
def test_every_recipe_validates_and_plans_to_fit_its_gpu(entry):
    recipe = _offline(api.load_recipe(entry["path"]))
    data = (ROOT / recipe.data.path).resolve()
    assert data.is_file() and data.is_relative_to(ROOT)  # runnable as shipped, from the repository alone
    gib = _gpu_gib(entry["title"])
    if gib is None:  # the quickstarts run anywhere: plan them for a 24 GB card
        plan = api.plan(recipe, gpu_memory="24GiB", device="cuda")
    else:  # the recipe's own budget: `finetune plan` on a machine without that GPU plans for it, not the CPU
        assert recipe.memory.gpu_memory == gib * GIB, entry["name"]
        plan = api.plan(recipe)
        assert plan.device == "cuda" and plan.budget_bytes == gib * GIB - recipe.memory.gpu_memory_margin
    assert plan.fits, f"{entry['name']} needs {plan.min_budget_bytes} bytes, written for {gib or 24} GB"
    resolved = plan.apply(recipe).recipe
    assert not auto_keys(resolved)


@pytest.mark.parametrize("goal", list(GOALS))
def test_a_goal_writes_its_values_and_keeps_the_rest(goal):
    base = api.load_recipe(ROOT / "recipes" / "quickstart.yaml")
    chosen = api.apply_goal(base, goal)
    data = chosen.model_dump(mode="python")
    for key, value in GOALS[goal].items():
        section, field = key.split(".")
        assert data[section][field] == value, key
    assert chosen.model.path == base.model.path and chosen.data.path == base.data.path


def test_an_unknown_goal_names_the_known_ones():
    with pytest.raises(KeyError, match="quick test"):
        api.apply_goal(api.load_recipe(ROOT / "recipes" / "quickstart.yaml"), "fastest")


def test_gpu_sizes_sweep_grows_with_the_gpu_and_agrees_with_the_planner(tmp_path):
    from finetune.testing import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "model", max_position_embeddings=1 << 20)
    recipe = Recipe.model_validate({
        "model": {"path": str(model)}, "data": {"path": "unused", "max_seq_len": 1024},
        "quantization": {"bits": None}, "training": {"micro_batch_size": "auto"},
        "memory": {"activation_checkpointing": True, "chunked_loss": False, "tiled_mlp": False, "offload": "none"},
        "output": {"dir": str(tmp_path / "run")}})
    sizes = (2, 3)  # GiB: the tiny model's sequences outgrow these at a few hundred thousand tokens
    sweep = api.plan_gpu_sizes(recipe, sizes, ladder=(4096, 65536, 262144))
    rows = {r["gpu_gb"]: r for r in sweep["sizes"]}
    assert list(rows) == list(sizes)
    contexts = [rows[g]["longest_context"] or 0 for g in sizes]
    batches = [rows[g]["largest_micro_batch"] or 0 for g in sizes]
    assert contexts == sorted(contexts) and contexts[-1] > contexts[0]
    assert batches == sorted(batches)
    from finetune.plan.search import MICRO_BATCHES

    assert sweep["micro_batch_cap"] == max(MICRO_BATCHES) >= max(sweep["micro_batch_need_bytes"])  # the most tried
    assert sweep["context_need_bytes"] == dict(sorted(sweep["context_need_bytes"].items()))
    assert contexts[0] % 256 == 0 and 65536 < contexts[0] < 262144  # interpolated between ladder points
    # The reported length is one the planner itself says fits that GPU, and twice it does not.
    gb = sizes[0]
    at = recipe.model_copy(deep=True)
    at.training.micro_batch_size = 1
    at.data.max_seq_len = rows[gb]["longest_context"]
    assert api.plan(at, gpu_memory=f"{gb}GiB", device="cuda").fits
    at.data.max_seq_len = rows[gb]["longest_context"] * 2
    assert not api.plan(at, gpu_memory=f"{gb}GiB", device="cuda").fits


def test_speed_estimate_is_rounded_names_its_basis_and_is_never_absurd():
    est = api.speed_estimate({"device": "cuda", "tokens_per_s": 1559.55})
    assert est["tokens_per_s"] == 1600 and est["text"] == "about 1,600 tokens/s" and est["short"] == "~1,600"
    assert "RTX 4090" in est["basis"] and "TFLOP/s" in est["basis"]
    tiny = api.speed_estimate({"device": "cuda", "tokens_per_s": 3.2e8})
    assert tiny["tokens_per_s"] is None and "over 100,000 tokens/s" in tiny["text"]
    assert "desktop CPU" in api.speed_estimate({"device": "cpu", "tokens_per_s": 500})["basis"]
    assert api.speed_estimate({"device": "cuda"})["text"] == "no speed estimate"
