"""Which server files the UI may read or write: only inside the folders allowed with `--allow-dir` (and
the runs folder), and uploads only from Gradio's own upload cache.

A web page must not become a way to read `/etc/shadow` or write over a home folder, so every path that
comes from the page (a data file, a model folder, a chat template, an offload or output dir, an export
target, a run, an upload) is resolved (symlinks and `..`) and checked here.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.recipe.schema import Recipe
from finetune.rundir import EXPORT_MARKER, RunDir
from finetune.rundir import MARKER as RUN_MARKER

DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
SNIFF_BYTES = 1 << 20  # a .json file up to this size is read to tell a dataset from a model config or a report
RECIPE_SUFFIXES = (".yaml", ".yml")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

# Every recipe key that names a server file or folder, and how its value is read. The schema has no
# marker for "this string is a path", so tests/test_ui_security.py checks that each string key of the
# schema is either here or in NOT_PATHS: a new path key cannot slip past unchecked.
PATH_KEYS = {
    "model.path": "model",  # a local folder or .gguf, a hub id, or pkg:PACKAGE/FILE
    "data.path": "path",
    "adapter.init_from": "path",  # a run directory or adapter folder whose weights are read
    "data.chat_template": "template",  # template text, or a path to one (as finetune.data.chat reads it)
    "memory.offload_dir": "path",
    "output.dir": "path",
    "distributed.deepspeed_nvme_path": "path",  # DeepSpeed writes optimizer state there
}
NOT_PATHS = ("model.revision", "adapter.target_modules", "adapter.modules_to_save", "data.system_prompt", "optimizer.target_modules")


class PathNotAllowed(FinetuneError):
    """A path from the page lies outside the allowed folders."""


def _resolve(raw: str, what: str) -> Path:
    try:
        return Path(raw).expanduser().resolve()
    except (ValueError, OSError, RuntimeError) as exc:  # NUL byte, symlink loop, name too long
        raise FinetuneError(f"{what} {raw!r} is not a usable path: {exc}") from None


def is_inside(path: Path, roots: Iterable[Path]) -> bool:
    """True if `path`, symlinks and `..` resolved, is one of `roots` or lies below one."""
    try:
        path = path.resolve()
    except (ValueError, OSError, RuntimeError):
        return False
    return any(path == root or root in path.parents for root in roots)


def allowed_path(raw: str, roots: list[Path], what: str, must_exist: bool = False) -> Path:
    """`raw` resolved (relative to the working directory); refused unless inside one of `roots`."""
    if not raw or not str(raw).strip():
        raise FinetuneError(f"no {what} given")
    path = _resolve(str(raw).strip(), what)
    if not is_inside(path, roots):
        raise PathNotAllowed(
            f"{what} {path} is outside the allowed folders ({', '.join(map(str, roots))})",
            hint="pick a file inside them, or restart the UI with --allow-dir FOLDER")
    if must_exist and not path.exists():
        raise FinetuneError(f"{what} {path} does not exist")
    return path


def _check_model(raw: str, roots: list[Path]) -> None:
    """A local model (or the folder of `random:FOLDER`) must be inside the allowed folders; `pkg:` must stay
    inside its installed package; a hub id (owner/name, no such local folder) comes from the HF cache or hub."""
    if raw.startswith("pkg:"):
        from finetune.model.source import package_file

        package = raw.removeprefix("pkg:").partition("/")[0]
        home = package_file(f"pkg:{package}/").resolve()  # a clear error if the package is not installed
        if not is_inside(package_file(raw), [home]):
            raise PathNotAllowed(f"model.path {raw} leaves the folder of package {package}",
                                 hint="use pkg:PACKAGE/FILE with FILE inside the package")
        return
    from finetune.model.random_weights import random_folder

    folder = random_folder(raw)
    if folder is not None:  # random weights, but config.json and the tokenizer are read from FOLDER
        allowed_path(str(folder), roots, "model.path (random:)")
        return
    if HUB_ID.fullmatch(raw) and ".." not in raw and not Path(raw).exists():
        return
    allowed_path(raw, roots, "model.path")


def check_recipe_paths(recipe: Recipe, roots: list[Path]) -> None:
    """Refuse a recipe that would read or write any file outside `roots` (every key in PATH_KEYS, and the file
    of each kind python reward)."""
    for key, file in recipe.grpo.python_files("grpo."):
        allowed_path(file, roots, key)
    for key, kind in PATH_KEYS.items():
        section, name = key.split(".")
        value = getattr(getattr(recipe, section), name)
        if key == "data.path":
            check_data_paths(recipe, roots)
            continue
        if value is None or value == "":
            continue
        if kind == "model":
            _check_model(value, roots)
        elif kind == "template" and "{" in value:  # Jinja text, not a file name
            continue
        else:
            allowed_path(value, roots, key)


def check_data_paths(recipe: Recipe, roots: list[Path], must_exist: bool = False) -> None:
    """Refuse a recipe whose data.path, or any file of its list, lies outside `roots` (named by its key,
    `data.path[2]`)."""
    for key, entry in zip(recipe.data.file_keys(), recipe.data.files(), strict=True):
        allowed_path(entry.path, roots, key, must_exist=must_exist)


def _holds_no_data(folder: Path) -> bool:
    """A folder whose .json files are a tool's or a model's, not a dataset: a run directory (metrics, plan,
    status, checkpoints), an export, an adapter or model folder, a hidden or cache folder."""
    return (folder.name.startswith(".") or folder.name in ("__pycache__", "node_modules") or RunDir(folder).exists()
            or any((folder / name).is_file() for name in (RUN_MARKER, EXPORT_MARKER, "adapter_config.json",
                                                           "config.json")))


def _reads_as_records(path: Path) -> bool:
    """Whether a data-suffixed file is a dataset: a small .json file is read as the run would read it (a model's
    config.json or a benchmark's results are JSON objects, not records); other files go by their suffix."""
    if path.suffix != ".json" or path.stat().st_size > SNIFF_BYTES:
        return True
    from finetune.data.read import read_records

    try:
        return all(isinstance(r.value, dict) for r in read_records(path).records)
    except FinetuneError:
        return False


def data_files(roots: list[Path], limit: int = 300) -> list[str]:
    """Dataset files found under the allowed folders (three levels deep), for the file picker; run
    internals (metrics.jsonl, checkpoints/, adapter/), model files and .json files that are no records (a model
    config, a report) are left out."""
    found: list[str] = []
    skip: dict[Path, bool] = {}  # folder -> whether it or a folder above it (below the root) holds no data
    for root in roots:
        for depth in ("*", "*/*", "*/*/*"):
            for path in sorted(root.glob(depth)):
                folders = [f for f in path.parents if f != root and root in f.parents]
                if path.suffix in DATA_SUFFIXES and path.is_file() and is_inside(path, roots) \
                        and not any(skip.setdefault(f, _holds_no_data(f)) for f in folders) \
                        and _reads_as_records(path):
                    found.append(str(path))
                    if len(found) >= limit:
                        return found
    return found


def upload_folder() -> Path:
    """Where Gradio stores files uploaded through the page (GRADIO_TEMP_DIR, else <tmp>/gradio)."""
    from gradio.utils import get_upload_folder

    return Path(get_upload_folder()).resolve()


def uploaded_file(raw: str | Path, suffixes: tuple[str, ...], what: str) -> Path:
    """An upload as Gradio handed it over: a regular file inside its upload cache, with one of `suffixes`.
    A server path sent as if it were an upload is refused, so the API cannot read files it names."""
    path = _resolve(str(raw), what)
    if not is_inside(path, [upload_folder()]) or not path.is_file():
        raise PathNotAllowed(f"{what} {Path(str(raw)).name} was not uploaded through the page",
                             hint="upload the file with the page's upload box; server files are picked by path")
    if path.suffix.lower() not in suffixes:
        raise FinetuneError(f"{path.name} is not a {what}: expected one of {', '.join(suffixes)}")
    return path


def store_upload(uploaded: str | Path, uploads_dir: Path) -> Path:
    """Copy an uploaded dataset (in Gradio's upload cache) to `uploads_dir`, where a run process can read it."""
    src = uploaded_file(uploaded, DATA_SUFFIXES, "dataset file")
    uploads_dir.mkdir(parents=True, exist_ok=True)
    dest = uploads_dir / src.name
    shutil.copyfile(src, dest)
    return dest
