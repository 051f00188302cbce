"""docs/vision.md's pixel-budget table is the planner's own output: each vision-language family's full-size
config planned for one QLoRA recipe at 8, 16 and 24 GiB (`finetune.plan.pixel_table`), and a larger GPU never
gets a smaller image budget."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def _ready_recipes() -> dict[Path, tuple[str, int]]:
    """Each ready Qwen-VL QLoRA recipe -> (the table's model name, its card's GiB)."""
    from finetune.api import load_recipe

    return {path: (load_recipe(path).model.path.split("/")[-1], int(path.stem.rsplit("-", 1)[1].removesuffix("gb")))
            for path in sorted(ROOT.glob("recipes/qlora-qwen*-vl-*gb.yaml"))}


def _cells(row: str) -> list[str]:
    """A table row's cells, the model's name first."""
    return row.removeprefix("| ").removesuffix(" |").split(" | ")


def test_the_docs_pixel_budget_table_has_a_row_per_vision_family_and_the_ready_recipes_are_its_recipe():
    """The table's frame (its header, one row per MODELS entry, in order; each cell the planner's: the next
    test, per model and card, so that the planning spreads over the test processes), a larger GPU never given
    a smaller image budget in a row, and each ready Qwen-VL QLoRA recipe the table's recipe for its card (that
    its plan there fits: the next test)."""
    import json

    from finetune.api import load_recipe
    from finetune.plan.pixel_table import RECIPE

    covered = {family_for(json.loads((CONFIGS / f).read_text())["model_type"]).name for f in MODELS.values()}
    assert covered == {f.name for f in FAMILIES if f.vision is not None}  # every vision family has its row
    table = docs_table(DOCS.read_text()).splitlines()
    assert table[:2] == pixel_budget_markdown({}).splitlines(), "regenerate the table: python -m " \
        "finetune.plan.pixel_table --docs"
    assert [_cells(row)[0] for row in table[2:]] == list(MODELS)
    for row in table[2:]:
        name, *cells = _cells(row)
        chosen = [0 if c.startswith("does not fit") else int(c.split(" px")[0].replace(",", "")) for c in cells]
        assert len(chosen) == len(GPU_SIZES) and chosen == sorted(chosen), (name, chosen)  # more memory: never less

    def settings(path: Path) -> dict:
        values = load_recipe(path).model_dump(mode="json")
        for section, key in (("model", "path"), ("memory", "gpu_memory"), ("output", "dir")):
            del values[section][key]
        return values

    recipes = _ready_recipes()
    assert len(recipes) == 5
    for path, (name, gib) in recipes.items():
        assert settings(path) == settings(RECIPE), path.name
        assert name in MODELS and gib in GPU_SIZES, path.name


@pytest.mark.parametrize("gib", GPU_SIZES, ids=lambda gib: f"{gib}GiB")
@pytest.mark.parametrize("name", list(MODELS), ids=[Path(f).stem for f in MODELS.values()])
def test_the_docs_pixel_budget_table_is_the_planners_and_grows_with_the_gpu(name, gib):
    """`name`'s cell for a `gib` GiB card is the planner's output (so the row's growth with the GPU, checked on
    the table above, is the planner's), and a ready recipe for the model and card fits."""
    plan, = budget_plans({name: str(CONFIGS / MODELS[name])}, (gib,))[name]  # on pixel_table.MACHINE
    assert plan.fits == (plan.peak_bytes <= plan.budget_bytes) and plan.budget_bytes <= parse_bytes(f"{gib}GiB")
    for path, ready in _ready_recipes().items():
        if ready == (name, gib):
            assert plan.fits, path.name
    cell = _cells(pixel_budget_markdown({name: [plan]}, (gib,)).splitlines()[2])[1]
    rows = [_cells(r) for r in docs_table(DOCS.read_text()).splitlines() if r.startswith(f"| {name} |")]
    assert [r[1 + GPU_SIZES.index(gib)] for r in rows] == [cell], \
        f"regenerate the table: python -m finetune.plan.pixel_table --docs\n{name} at {gib} GiB: {cell}"


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
