"""adapter.init_from: train on from an earlier adapter (DPO after SFT, or more SFT).

Torch-free on purpose: the planner must price, and the run build, the adapter that will really be trained,
so its shape (type, r, alpha, rslora, target_modules, modules_to_save) is read from the saved
adapter_config.json before planning. What wins: the saved adapter's shape (its weights only fit that shape);
a recipe key set to a different value is an error naming both, a key left at its default takes the adapter's
value, and `target_modules: all-linear` accepts the adapter's list. dropout and fp32_compute are training
knobs and stay the recipe's. The weights are loaded later by `finetune.model.adapter` (safetensors only).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import RecipeError
from finetune.recipe.schema import AdapterConfig, Recipe
from finetune.rundir import RunDir

KEY = "adapter.init_from"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SHAPE_KEYS = ("type", "r", "alpha", "rslora", "target_modules", "modules_to_save")


@dataclass(frozen=True)
class StartAdapter:
    """A saved LoRA/DoRA adapter to start from: its folder, the run it came from (if any) and its shape."""

    folder: Path  # holds adapter_config.json and adapter_model.safetensors
    run: Path | None  # the run directory whose adapter/ it is
    shape: dict[str, Any]  # AdapterConfig values: type, r, alpha, rslora, target_modules, modules_to_save

    @property
    def weights(self) -> Path:
        return self.folder / WEIGHTS_FILE


def start_adapter(raw: str) -> StartAdapter:
    """The adapter `adapter.init_from: raw` names; RecipeError naming the key if it is not a usable one."""
    path = Path(raw).expanduser()
    if not path.exists():
        raise RecipeError(f"{KEY}: {raw} does not exist",
                          hint="give a run directory (with adapter/) or a LoRA/DoRA adapter folder")
    run = RunDir(path)
    if run.recipe.is_file():
        if not run.has_adapter():
            raise RecipeError(f"{KEY}: {raw} is a run directory without a trained adapter ({run.adapter.name}/ "
                              "is missing)", hint="finish that run first (finetune run RECIPE --resume)")
        folder = run.adapter
    else:
        folder, run = path, None
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        what = ("a full fine-tune (a whole model), not an adapter" if (folder / "config.json").is_file()
                else f"not an adapter folder (no {CONFIG_FILE})")
        raise RecipeError(f"{KEY}: {folder} is {what}",
                          hint="start from a LoRA/DoRA run, or leave adapter.init_from out")
    if not (folder / WEIGHTS_FILE).is_file():
        raise RecipeError(f"{KEY}: {folder} has no {WEIGHTS_FILE}; only safetensors weights are loaded (a pickled "
                          "adapter_model.bin can run code when loaded)",
                          hint="save the adapter with save_pretrained(..., safe_serialization=True)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        shape = _shape(config)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise RecipeError(f"{KEY}: {config_file} is not a readable LoRA adapter config: {exc!r}") from None
    if config.get("peft_type") != "LORA":
        raise RecipeError(f"{KEY}: {folder} is a {config.get('peft_type')} adapter; only LoRA/DoRA adapters can be "
                          "trained on")
    unsupported = [k for k in ("rank_pattern", "alpha_pattern", "layers_to_transform") if config.get(k)]
    unsupported += ["bias"] if config.get("bias", "none") != "none" else []
    if unsupported:
        raise RecipeError(f"{KEY}: {folder} uses {', '.join(unsupported)}, which a recipe's adapter section "
                          "cannot express")
    return StartAdapter(folder.resolve(), run.root.resolve() if run is not None else None, shape)


def _shape(config: dict[str, Any]) -> dict[str, Any]:
    targets = config["target_modules"]
    return {"type": "dora" if config.get("use_dora") else "lora", "r": int(config["r"]),
            "alpha": float(config["lora_alpha"]), "rslora": bool(config.get("use_rslora")),
            "target_modules": sorted(targets) if isinstance(targets, list) else targets,
            "modules_to_save": sorted(config["modules_to_save"]) if config.get("modules_to_save") else None}


def _same(key: str, mine: Any, theirs: Any) -> bool:
    if key == "target_modules" and mine == "all-linear":
        return True  # all-linear names whatever the model's linear layers are: the adapter's list
    if isinstance(mine, list) or isinstance(theirs, list):
        return sorted(mine or []) == sorted(theirs or [])
    return mine == theirs


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def resolve_init_from(recipe: Recipe) -> Recipe:
    """The recipe with adapter.init_from resolved: an absolute path, and the adapter's shape in the adapter
    section (see the module docstring for what wins). Unchanged without init_from; idempotent."""
    raw = recipe.adapter.init_from
    if raw is None:
        return recipe
    start = start_adapter(raw)
    if start.run is not None and start.run == Path(recipe.output.dir).expanduser().resolve():
        raise RecipeError(f"{KEY}: {raw} is this recipe's own output.dir; a run cannot start from itself",
                          hint="use --resume to continue a run, or give the new run another output.dir")
    if start.run is not None:
        from finetune.recipe.load import load_recipe

        parent = load_recipe(RunDir(start.run).recipe)
        if not _same_model(parent.model.path, recipe.model.path) or parent.model.revision != recipe.model.revision:
            raise RecipeError(f"{KEY}: {start.run} trained on model.path {parent.model.path}, this recipe trains "
                              f"{recipe.model.path}; an adapter fits only the base model it was trained on",
                              hint="start from a run of the same base model, or change model.path")
    given = recipe.adapter.model_fields_set
    problems = [f"adapter.{key}: the recipe sets {getattr(recipe.adapter, key)!r}, the adapter has {value!r}"
                for key, value in start.shape.items()
                if key in given and not _same(key, getattr(recipe.adapter, key), value)]
    if problems:
        raise RecipeError(f"{KEY}: {start.folder} does not fit the recipe's adapter section (the saved adapter's "
                          "shape wins):", problems,
                          hint="remove those keys from the recipe (they are taken from the adapter) or set them "
                               "to the adapter's values")
    adapter = AdapterConfig.model_validate({**recipe.adapter.model_dump(), **start.shape,
                                            "init_from": str(start.run or start.folder)})
    return recipe.model_copy(update={"adapter": adapter})


def init_from_record(raw: str) -> dict[str, Any]:
    """What results.json records about the start adapter: its folder, its run and its weights' sha256 (the
    parent run may be trained again later; the hash says which weights this run started from)."""
    start = start_adapter(raw)
    digest = hashlib.sha256()
    with start.weights.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"adapter": str(start.folder), "run": str(start.run) if start.run is not None else None,
            "sha256": digest.hexdigest()}
