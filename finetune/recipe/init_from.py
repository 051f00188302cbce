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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import RecipeError, RecipeProblem
from finetune.recipe.schema import AdapterConfig, Recipe
from finetune.rundir import RunDir

KEY = "adapter.init_from"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_CACHE_SIZE = 64  # files kept by _read_cached (a few per start adapter)
_READS: dict[tuple[str, str], tuple[tuple[int, ...], Any]] = {}  # (kind, path) -> (_stamp, value)
_DIGESTS: dict[tuple[str | int, ...], str] = {}  # (weights file, *_stamp) -> sha256, from read_weights


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
        config = _read_cached("config", config_file, lambda f: json.loads(f.read_text(encoding="utf-8")))
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


def _stamp(path: Path) -> tuple[int, ...]:
    """Changes whenever the file does: the inode and change time too, so a same-size file renamed over it
    within the file system's clock tick (an atomic rewrite) counts as changed."""
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size, stat.st_ino, stat.st_ctime_ns


def _read_cached(kind: str, path: Path, read: Callable[[Path], Any]) -> Any:
    """`read(path)`, read again only when the file changed (`_stamp`; the value is shared: callers must not
    change it)."""
    stamp, key = _stamp(path), (kind, str(path))
    hit = _READS.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    value = read(path)
    if len(_READS) >= _CACHE_SIZE:
        _READS.clear()
    _READS[key] = (stamp, value)
    return value


def _parent_model(recipe_file: Path) -> tuple[str, str | None]:
    """model.path and model.revision of the run a start adapter comes from (its recipe.yaml)."""
    from finetune.recipe.load import load_recipe

    def read(path: Path) -> tuple[str, str | None]:
        parent = load_recipe(path)
        return parent.model.path, parent.model.revision

    return _read_cached("recipe", recipe_file, read)


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
        parent_path, parent_revision = _parent_model(RunDir(start.run).recipe)
        if not _same_model(parent_path, recipe.model.path) or parent_revision != recipe.model.revision:
            raise RecipeError(f"{KEY}: {start.run} trained on model.path {parent_path}, this recipe trains "
                              f"{recipe.model.path}; an adapter fits only the base model it was trained on",
                              hint="start from a run of the same base model, or change model.path")
    given = recipe.adapter.model_fields_set
    problems = [RecipeProblem(f"adapter.{key}: the recipe sets {getattr(recipe.adapter, key)!r}, the adapter has "
                              f"{value!r}", f"adapter.{key}", "value")
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


def read_weights(start: StartAdapter, digest: bool = False) -> bytes:
    """The start adapter's safetensors file, read once for the whole build (the trained adapter and the
    frozen reference are both loaded from these bytes). `digest`: hash these very bytes for
    `init_from_record` (one process of several does it; the others skip the hashing)."""
    stamp = _stamp(start.weights)
    data = start.weights.read_bytes()
    if digest:
        if len(_DIGESTS) >= _CACHE_SIZE:
            _DIGESTS.clear()
        _DIGESTS[(str(start.weights), *stamp)] = hashlib.sha256(data).hexdigest()
    return data


def init_from_record(raw: str) -> dict[str, Any]:
    """What results.json records about the start adapter: its folder, its run and its weights' sha256 (the
    parent run may be trained again later; the hash says which weights this run started from): the hash
    `read_weights(digest=True)` took of the bytes it loaded while the file is unchanged, else the file's."""
    start = start_adapter(raw)
    sha = _DIGESTS.get((str(start.weights), *_stamp(start.weights)))
    if sha is None:
        digest = hashlib.sha256()
        with start.weights.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        sha = digest.hexdigest()
    return {"adapter": str(start.folder), "run": str(start.run) if start.run is not None else None,
            "sha256": sha}
