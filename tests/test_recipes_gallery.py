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
from finetune.testing import stated_machine

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
# Hub ids of the recipes -> the config fixture with the same shapes (tests are offline).
HUB_CONFIGS = {"meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b.json", "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b.json",
               "Qwen/Qwen3-8B": "qwen3-8b.json"}
HUB_CONFIGS.update({"Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b.json", "openai/gpt-oss-20b": "gpt-oss-20b.json",
                    "Qwen/Qwen2.5-VL-3B-Instruct": "qwen2.5-vl-3b.json", "Qwen/Qwen3-VL-8B-Instruct": "qwen3-vl-8b.json"})
HUB_CONFIGS.update({"meta-llama/Llama-3.3-70B-Instruct": "llama-3.1-70b.json",  # Llama 3.1's 70B shapes
                    "Qwen/Qwen3-32B": "qwen3-32b.json", "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b.json"})
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


def _machine(description: str) -> tuple[int | None, int | None]:
    """(host RAM, free disk) bytes of the machine a recipe's description names ("with 64 GB of RAM", "an NVMe
    SSD with 200 GB free"): what a weight-streaming recipe needs besides its GPU (None: not named)."""
    ram = re.search(r"(\d+) GB of RAM", description)
    disk = re.search(r"(\d+) GB free", description)
    return (int(ram.group(1)) * 10**9 if ram else None), (int(disk.group(1)) * 10**9 if disk else None)


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
    with stated_machine(*_machine(entry["description"])):  # the RAM and SSD it names, where it names them
        if gib is None:  # the quickstarts run anywhere: plan them for a 24 GB card
            plan = api.plan(recipe, gpu_memory="24GiB", device="cuda")
        else:  # the recipe's own budget: `finetune plan` on a machine without that GPU plans for it, not the CPU
            assert recipe.memory.gpu_memory == gib * GIB, entry["name"]
            plan = api.plan(recipe)
            assert plan.device == "cuda" and plan.budget_bytes == gib * GIB - recipe.memory.gpu_memory_margin
    assert plan.fits, f"{entry['name']} needs {plan.min_budget_bytes} bytes, written for {gib or 24} GB"
    resolved = plan.apply(recipe).recipe
    assert not auto_keys(resolved)


@pytest.mark.parametrize(("name", "tier"), [("qlora-llama-3.3-70b-24gb", "cpu"), ("qlora-llama-3.3-70b-16gb", "cpu"),
                                            ("qlora-qwen3-32b-12gb", "cpu"), ("qlora-qwen3-235b-a22b-24gb", "disk")])
def test_models_larger_than_their_card_stream_their_weights(name, tier):
    """The weight-streaming recipes: on the machine each names, the plan streams from RAM (or the SSD, for the
    235B mixture of experts, its experts with the layers); without streaming nothing fits that card."""
    entry = next(r for r in GALLERY if r["name"] == name)
    recipe = _offline(api.load_recipe(entry["path"]))
    with stated_machine(*_machine(entry["description"])):
        plan = api.plan(recipe)
        resident = api.plan(recipe.model_copy(update={"memory": recipe.memory.model_copy(
            update={"offload_weights": "none"})}))
    assert plan.fits and plan.settings["offload_weights"] == tier
    assert any("bound by" in note for note in plan.notes)
    assert not resident.fits


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
