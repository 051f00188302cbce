"""The image files of vision-language records, checked from their headers before anything trains.

Why before: a bad image is a bad record (named with its file, record and image path), found in seconds by
the preflight rather than minutes into a run.

More in docs/vision.md, "Reading the images (finetune/data/images.py)".
"""

from __future__ import annotations

import functools
import os
import sqlite3
import struct
import threading
import warnings
from typing import Any

from finetune.data.formats import Example, RecordError, images_of
from finetune.units import cache_dir

TAIL = 64 << 10  # bytes read from a file's end to find its end marker
# The widest aspect ratio an image may have: transformers' smart_resize (Qwen-VL) refuses more than 200, and
# an image that narrow trains nothing in any family
MAX_ASPECT_RATIO = 200
_UNREADABLE = (OSError, SyntaxError, ValueError, EOFError, struct.error)  # what Pillow's plugins raise on bad bytes


def check_images(example: Example, model_takes_images: bool) -> list[tuple[int, int]]:
    """The (width, height) of each image of `example`, in order; RecordError naming the first bad image, or
    any image when the model reads only text (`model_takes_images`: the model family's vision flag)."""
    paths = images_of(example)
    if paths and not model_takes_images:
        raise RecordError(f"has {len(paths)} image(s) but the model reads only text: train a vision-language model "
                          "on it, or leave the image records out")
    return [image_size(path) for path in paths]


def image_sizes(example: Example) -> list[tuple[int, int]]:
    """The (width, height) of each image of `example` from the files' headers (no decoding), for counting
    image tokens (`finetune.data.image_tokens`); RecordError for a bad image."""
    return check_images(example, model_takes_images=True)


def image_size(path: str) -> tuple[int, int]:
    """One image's (width, height), the file read and decoded once (cached); RecordError saying what is wrong
    with the file."""
    if "\x00" in path:
        raise RecordError(f"image path {path!r} holds a NUL byte, which no file name can; fix the path")
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise RecordError(f"image {path} does not exist") from None
    except OSError as exc:
        raise RecordError(f"image {path} cannot be read ({exc.strerror or exc})") from None
    size, problem = _checked(path, stat.st_mtime_ns, stat.st_size)
    if problem:
        raise RecordError(f"image {path} {problem}")
    return size


@functools.lru_cache(maxsize=1 << 16)
def _checked(path: str, mtime_ns: int, length: int) -> tuple[tuple[int, int], str | None]:
    """_check's answer for this file version, from this process's memory, else from the check cache on disk
    (so `run` reuses what `validate` decoded: a full decode is ~30 ms an image), else checked now and kept."""
    from PIL import Image

    key = (os.path.abspath(path), mtime_ns, length, Image.MAX_IMAGE_PIXELS or 0, CHECK_VERSION)
    known = CHECKS.get(key)
    if known is not None:
        return known
    answer = _check(path, length)
    CHECKS.put(key, answer)
    return answer


CHECK_VERSION = 1  # bump when _check's answers change, so no answer of an older check is reused


class CheckCache:
    """Image check answers kept on disk (SQLite under cache_dir()), keyed by the file's path, mtime and size.

    Only an optimisation: a cache that cannot be opened or written (no room, a read-only home, a cache path
    that is a file) is left unused, and every image is then checked in each process as before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._broken = False
        self._pid = os.getpid()

    def _open(self) -> sqlite3.Connection | None:
        if self._pid != os.getpid():  # a forked worker: the parent's connection is not its to use
            self._db, self._broken, self._pid = None, False, os.getpid()
        if self._db is None and not self._broken:
            try:
                folder = cache_dir()
                folder.mkdir(parents=True, exist_ok=True)
                db = sqlite3.connect(folder / "image_checks.sqlite", timeout=5, check_same_thread=False)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")  # a commit without fsync: a lost answer is checked again
                db.execute("CREATE TABLE IF NOT EXISTS checks (path TEXT, mtime_ns INTEGER, length INTEGER, "
                           "max_pixels INTEGER, version INTEGER, width INTEGER, height INTEGER, problem TEXT, "
                           "PRIMARY KEY (path, mtime_ns, length, max_pixels, version))")
                self._db = db
            except (OSError, sqlite3.Error):
                self._broken = True
        return self._db

    def get(self, key: tuple) -> tuple[tuple[int, int], str | None] | None:
        with self._lock:
            db = self._open()
            if db is None:
                return None
            try:
                row = db.execute("SELECT width, height, problem FROM checks WHERE path=? AND mtime_ns=? AND "
                                 "length=? AND max_pixels=? AND version=?", key).fetchone()
            except sqlite3.Error:
                return None
            return None if row is None else ((row[0], row[1]), row[2])

    def put(self, key: tuple, answer: tuple[tuple[int, int], str | None]) -> None:
        with self._lock:
            db = self._open()
            if db is None:
                return
            (width, height), problem = answer
            try:
                with db:
                    db.execute("INSERT OR REPLACE INTO checks VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                               (*key, width, height, problem))
            except sqlite3.Error:
                self._broken = True


CHECKS = CheckCache()


def _check(path: str, length: int) -> tuple[tuple[int, int], str | None]:
    """((width, height), None), or ((0, 0), what is wrong with the file."""
    from PIL import Image

    if length == 0:
        return (0, 0), "is empty (0 bytes)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # measured below, as a bad record
            with Image.open(path) as image:
                (width, height), kind = image.size, image.format
    except Image.DecompressionBombError:
        return (0, 0), _bomb()
    except _UNREADABLE as exc:
        return (0, 0), f"is not an image Pillow can read ({type(exc).__name__}: {exc})"
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        return (0, 0), _bomb(width, height)
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        return (0, 0), (f"is {width}x{height}, an aspect ratio over {MAX_ASPECT_RATIO}:1, which the vision "
                        "processors refuse; crop or pad it")
    if not _complete(path, kind, length):
        return (0, 0), f"is cut short (a {kind} file without its end): the file is truncated, replace it"
    return (width, height), _decode(path)


def _decode(path: str) -> str | None:
    """None where the whole image decodes, else what fails: a corrupt stream behind a good header."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # sized above
            with Image.open(path) as image:
                image.load()
    except _UNREADABLE as exc:
        return f"cannot be decoded ({type(exc).__name__}: {exc}); replace the file"
    return None


def _bomb(width: int | None = None, height: int | None = None) -> str:
    from PIL import Image

    size = f"{width}x{height} = {width * height:,} pixels" if width and height else "more than twice that"
    return (f"is over Pillow's decompression-bomb limit of {Image.MAX_IMAGE_PIXELS:,} pixels "
            f"(PIL.Image.MAX_IMAGE_PIXELS): {size}; shrink it")


def _complete(path: str, kind: str | None, length: int) -> bool:
    """Whether the file reaches its format's end (JPEG, PNG, GIF, WebP; other formats are not checked)."""
    with open(path, "rb") as file:
        head = file.read(12)
        file.seek(max(0, length - TAIL))
        tail = file.read()
    if kind == "JPEG":
        return b"\xff\xd9" in tail
    if kind == "PNG":
        return b"IEND" in tail
    if kind == "GIF":
        return tail.rstrip(b"\x00").endswith(b";")
    if kind == "WEBP":
        return int.from_bytes(head[4:8], "little") + 8 <= length
    return True


def open_image(path: str) -> Any:
    """The image decoded as RGB (a PIL.Image), for the vision-language tokenizer; RecordError naming the file
    where its bytes fail to decode (or changed since they were checked)."""
    from PIL import Image

    image_size(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # sized by image_size
            with Image.open(path) as image:
                return image.convert("RGB")
    except _UNREADABLE as exc:
        raise RecordError(f"image {path} cannot be decoded ({type(exc).__name__}: {exc}); replace the file") from None
