"""docs/vision.md's pixel-budget table is the planner's own output: each vision-language family's full-size
config planned for one QLoRA recipe at 8, 16 and 24 GiB (`finetune.plan.pixel_table`), and a larger GPU never
gets a smaller image budget."""

from __future__ import annotations

from pathlib import Path

from finetune.plan.pixel_table import (
    CONFIGS,
    DOCS,
    GPU_SIZES,
    MODELS,
    budget_plans,
    docs_table,
    pixel_budget_markdown,
)
from finetune.recipe.families import FAMILIES, family_for
from finetune.units import parse_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_pixel_budget_table_is_the_planners_and_grows_with_the_gpu():
    import json

    covered = {family_for(json.loads((CONFIGS / f).read_text())["model_type"]).name for f in MODELS.values()}
    assert covered == {f.name for f in FAMILIES if f.vision is not None}  # every vision family has its row
    plans = budget_plans()  # on pixel_table.MACHINE: not this machine's free RAM, which moves with its load
    for name, per_gpu in plans.items():
        chosen = [p.settings["max_pixels"] if p.fits else 0 for p in per_gpu]
        assert chosen == sorted(chosen), (name, chosen)  # more memory: never a smaller image budget
        for gib, plan in zip(GPU_SIZES, per_gpu, strict=True):
            assert plan.fits == (plan.peak_bytes <= plan.budget_bytes) and plan.budget_bytes <= parse_bytes(f"{gib}GiB")
    # each ready Qwen-VL QLoRA recipe is the table's recipe for its card, and its plan there fits
    from finetune.api import load_recipe
    from finetune.plan.pixel_table import RECIPE

    def settings(path: Path) -> dict:
        values = load_recipe(path).model_dump(mode="json")
        for section, key in (("model", "path"), ("memory", "gpu_memory"), ("output", "dir")):
            del values[section][key]
        return values

    recipes = sorted(ROOT.glob("recipes/qlora-qwen*-vl-*gb.yaml"))
    assert len(recipes) == 5
    for path in recipes:
        name = load_recipe(path).model.path.split("/")[-1]
        assert settings(path) == settings(RECIPE), path.name
        assert plans[name][GPU_SIZES.index(int(path.stem.rsplit("-", 1)[1].removesuffix("gb")))].fits, path.name
    assert docs_table(DOCS.read_text()) == pixel_budget_markdown(plans), \
        "regenerate the table: python -m finetune.plan.pixel_table --docs\n" + pixel_budget_markdown(plans)


def test_the_image_budget_sets_the_planned_peak(tmp_path):
    """The photo's image tokens are the language model's sequence: a smaller pixel budget plans a shorter one and
    a lower peak (the plan once traced every budget at max_seq_len, so Qwen3-VL-8B's peak did not move)."""
    from finetune.plan.pixel_table import budget_recipe, write_photo_data
    from finetune.plan.search import predict

    data = write_photo_data(tmp_path)
    plans = []
    for pixels in (200704, 3211264):
        recipe = budget_recipe(str(CONFIGS / MODELS["Qwen3-VL-8B-Instruct"]), data, 24, tmp_path / "run")
        recipe.data.max_pixels = pixels
        recipe.training.micro_batch_size = 1
        plans.append(predict(recipe, device="cuda"))
    small, large = plans
    assert small.vision["image_tokens"] == 192 and large.vision["image_tokens"] == 3072
    assert small.vision["sequence"] < large.vision["sequence"] < 4096
    assert small.peak_bytes < large.peak_bytes
