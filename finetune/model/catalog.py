"""The models this machine already has, as values for model.path: local folders (config.json + safetensors) and
.gguf files under given folders, GGUF files shipped inside installed Python packages (`pkg:PACKAGE/FILE`), and
complete snapshots in the Hugging Face hub cache (their hub id, loaded from the cache offline).

A listing, not a loader: nothing is read but names and a few stats, so the UI's model picker can offer it on
every page load. Every local path is resolved (symlinks, `..`) and kept only inside the folders it was asked
about, so a link pointing out of them lists nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

from finetune.reports import LocalModel

DEPTH = 3  # folder levels searched below each folder (models/org/name)
LIMIT = 200  # models listed at most per folder
SKIPPED = ("__pycache__", "node_modules", "site-packages")  # never model folders, often huge


def is_model_folder(folder: Path) -> bool:
    """A Hugging Face model folder finetune loads: config.json beside safetensors weights."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _inside(path: Path, roots: list[Path]) -> Path | None:
    """`path` resolved, or None when it leaves every root (a symlink out, a `..`)."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        return None
    return resolved if any(resolved == r or resolved.is_relative_to(r) for r in roots) else None


def folder_models(folders: Iterable[Path], depth: int = DEPTH, limit: int = LIMIT) -> list[LocalModel]:
    """Model folders and .gguf files at most `depth` levels below each of `folders` (hidden folders skipped)."""
    roots = [Path(f).expanduser().resolve() for f in folders]
    found: dict[Path, LocalModel] = {}
    for root in roots:
        level, count = [root], 0
        for _ in range(depth + 1):
            below = []
            for folder in level:
                if count >= limit:
                    break
                if is_model_folder(folder):
                    found.setdefault(folder, {"path": str(folder), "label": f"{folder.name} (folder)",
                                              "kind": "folder"})
                    count += 1
                    continue  # a model's subfolders are its own (checkpoints of a full fine-tune, ...)
                try:
                    entries = sorted(folder.iterdir())
                except OSError:
                    continue
                for entry in entries:
                    if entry.name.startswith(".") or entry.name in SKIPPED or (inside := _inside(entry, roots)) is None:
                        continue
                    if entry.suffix == ".gguf" and inside.is_file():
                        found.setdefault(inside, {"path": str(inside), "label": f"{entry.name} (GGUF file)",
                                                  "kind": "gguf"})
                        count += 1
                    elif inside.is_dir():
                        below.append(inside)
            level = below
    return list(found.values())


@functools.cache
def package_models() -> tuple[LocalModel, ...]:
    """GGUF files shipped inside installed Python packages, as `pkg:PACKAGE/FILE` (the quickstart's model is
    one). Read from the packages' file lists once per process (a package installed later needs a restart)."""
    from importlib.metadata import distributions

    out: dict[str, LocalModel] = {}
    for dist in distributions():
        for file in dist.files or ():
            parts = file.parts
            if file.suffix == ".gguf" and len(parts) > 1 and parts[0].isidentifier():
                value = f"pkg:{'/'.join(parts)}"
                out[value] = {"path": value, "label": f"{parts[-1]} (package {dist.metadata['Name']})",
                              "kind": "package"}
    return tuple(out[k] for k in sorted(out))


def hub_cache_models(cache: Path | None = None) -> list[LocalModel]:
    """Models in the Hugging Face hub cache (`models--ORG--NAME/snapshots/REVISION`, HF_HOME or HF_HUB_CACHE)
    with a complete snapshot (config.json and safetensors), as their hub id: loaded from the cache offline."""
    if cache is None:
        from huggingface_hub import constants

        cache = Path(constants.HF_HUB_CACHE)
    out = []
    for repo in sorted(Path(cache).glob("models--*")):
        snapshots = repo / "snapshots"
        if snapshots.is_dir() and any(is_model_folder(s) for s in snapshots.iterdir()):
            repo_id = repo.name.removeprefix("models--").replace("--", "/")
            out.append({"path": repo_id, "label": f"{repo_id} (hub cache)", "kind": "hub cache"})
    return out
