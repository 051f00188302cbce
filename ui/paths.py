"""Which server files the UI may read or write: only inside the folders allowed with `--allow-dir`.

A web page must not become a way to read `/etc/shadow` or write over a home folder, so every path that
comes from the page (a data file, a model folder, an output dir, an export target) is checked here.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from finetune.errors import FinetuneError

DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")


class PathNotAllowed(FinetuneError):
    """A path from the page lies outside the allowed folders."""


def is_inside(path: Path, roots: Iterable[Path]) -> bool:
    path = path.resolve()
    return any(path == root or root in path.parents for root in roots)


def allowed_path(raw: str, roots: list[Path], what: str, must_exist: bool = False) -> Path:
    """`raw` resolved (relative to the working directory); refused unless inside one of `roots`."""
    if not raw or not str(raw).strip():
        raise FinetuneError(f"no {what} given")
    path = Path(str(raw).strip()).expanduser().resolve()
    if not is_inside(path, roots):
        raise PathNotAllowed(
            f"{what} {path} is outside the allowed folders ({', '.join(map(str, roots))})",
            hint="pick a file inside them, or restart the UI with --allow-dir FOLDER")
    if must_exist and not path.exists():
        raise FinetuneError(f"{what} {path} does not exist")
    return path


def data_files(roots: list[Path], limit: int = 300) -> list[str]:
    """Dataset files found under the allowed folders (three levels deep), for the file picker."""
    found: list[str] = []
    for root in roots:
        for depth in ("*", "*/*", "*/*/*"):
            for path in sorted(root.glob(depth)):
                if path.suffix in DATA_SUFFIXES and path.is_file() and ".ui" not in path.parts:
                    found.append(str(path))
                    if len(found) >= limit:
                        return found
    return found


def store_upload(uploaded: str | Path, uploads_dir: Path) -> Path:
    """Copy an uploaded file (in Gradio's temp folder) to `uploads_dir`, where a run process can read it."""
    src = Path(uploaded)
    if src.suffix.lower() not in DATA_SUFFIXES:
        raise FinetuneError(f"{src.name} is not a dataset file: expected one of {', '.join(DATA_SUFFIXES)}")
    uploads_dir.mkdir(parents=True, exist_ok=True)
    dest = uploads_dir / src.name
    shutil.copyfile(src, dest)
    return dest
