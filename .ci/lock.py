"""The tested versions (finetune/constraints.txt): written from the environment the suite passed in, checked
against what is installed, and moved to new releases in one deliberate step.

    .venv/bin/python .ci/lock.py freeze    # write the lock from this Python's environment
    .venv/bin/python .ci/lock.py check     # name every installed package that differs from the lock, and every
                                           # torch version written in the repository other than TORCH (exit 1)
    python3 .ci/lock.py upgrade            # fresh venv with the newest releases, the suite, and on green:
                                           # the lock, compat.CHECKED and pyproject's bounds follow

The lock holds the dependency closure of `finetune[dev,ui]` (what pip installs for the README's command) at
the versions of the environment it was written from; torch and what only torch needs are left out: CPU
installs pin the local torch wheel on the command line, GPU users bring their CUDA build (docs/development.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "finetune" / "constraints.txt"
COMPAT = ROOT / "finetune" / "compat.py"
PYPROJECT = ROOT / "pyproject.toml"
EXTRAS = ("dev", "ui")
# torch comes from the command line (CPU wheel) or the user's CUDA build; these come with a CUDA torch only.
LEFT_OUT = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
# Extras pinned here but installed only where they run (cuda: Liger Kernel, on CUDA machines: the Docker image and
# the GPU kit). Their own packages are pinned (not what they need: torch and triton, left out above), at the version
# installed where the lock is written, else the pin the lock already has: a new Liger is adopted on purpose too.
OPTIONAL = ("cuda",)
# The torch the suite runs on: the CPU wheel the README's install pins, the Docker image's base and its CPU
# stand-in, upgrade's venv. Each other copy in the repository (a literal: the README's command is run as written,
# a Dockerfile's ARG cannot read a file) equals this one, `torch_copies` names those that do not.
TORCH = "2.13.0"
# A torch version written down: torch==X, TORCH=X, torch X, torch-X, pytorch/pytorch:X (not apollo-torch==X).
TORCH_COPY = re.compile(r"(?<![\w-])(?:torch(?:==|=| |-)|pytorch/pytorch:)(\d+\.\d+\.\d+)", re.IGNORECASE)
# Records of what ran or what a machine holds, not versions to install.
RECORDS = ("benchmarks/results/", "benchmarks/gpu/image_packages.txt")
HEADER = """# The versions the test suite last passed on: the dependency closure of finetune[dev,ui], torch excepted
# (CPU installs pin the local wheel on the command line; GPU users bring their CUDA build), and the packages of
# the cuda extra (Liger Kernel; checked only where installed). Written by
# `.venv/bin/python .ci/lock.py freeze`; moved to new releases by `python3 .ci/lock.py upgrade` (docs/development.md).
# The README's install, .ci/run, the Docker image and the GPU kit's wheels (benchmarks/gpu/wheels.sh) read it.
"""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str = "finetune", extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """{normalized name: installed version} of every distribution `root[extras]` needs, transitively."""
    found: dict[str, str] = {}
    todo = [(root, set(extras))]
    base = default_environment()
    while todo:
        name, wanted = todo.pop()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        key = normalize(dist.metadata["Name"])
        if key in found and not wanted:
            continue
        found[key] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({**base, "extra": e})
                                                  for e in (wanted or {""})):
                continue
            if normalize(req.name) not in found or req.extras:
                todo.append((req.name, set(req.extras)))
    found.pop(normalize(root), None)
    return {k: v for k, v in sorted(found.items()) if not LEFT_OUT.match(k)}


def optional_names(root: str = "finetune") -> set[str]:
    """The packages the OPTIONAL extras add beyond the install's closure, by normalized name."""
    base = default_environment()
    names = set()
    for text in md.requires(root) or []:
        req = Requirement(text)
        if req.marker is not None and any(req.marker.evaluate({**base, "extra": e}) for e in OPTIONAL):
            names.add(normalize(req.name))
    return {n for n in names - set(closure(root)) if not LEFT_OUT.match(n)}


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def read_lock(path: Path = LOCK) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, pinned = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[normalize(name)] = pinned.strip()
    return pins


def drift(pins: dict[str, str]) -> list[str]:
    """One line per locked package whose installed version differs from its pin (or is missing; an optional
    extra's package only where it is installed)."""
    out = []
    optional = optional_names()
    for name, pinned in pins.items():
        installed = _installed(name)
        if installed is None and name in optional:
            continue
        if installed != pinned:
            out.append(f"{name} {installed or 'not installed'} installed, lock has {pinned}")
    return out


def torch_copies(root: Path = ROOT) -> list[str]:
    """One line (file:line) per torch version written in the repository's tracked files that is not TORCH."""
    files = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True,
                           check=True).stdout.split("\0")
    out = []
    for name in sorted(f for f in files if f and not f.startswith(RECORDS)):
        try:
            text = (root / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):  # binary, deleted, a submodule
            continue
        for number, line in enumerate(text.splitlines(), 1):
            out += [f"{name}:{number}: torch {m[1]}, .ci/lock.py's TORCH is {TORCH}"
                    for m in TORCH_COPY.finditer(line) if m[1] != TORCH]
    return out


def freeze(path: Path = LOCK) -> dict[str, str]:
    pins = closure()
    kept = read_lock(path) if path.exists() else {}
    for name in optional_names():
        version = _installed(name) or kept.get(name)
        if version:
            pins[name] = version
    pins = dict(sorted(pins.items()))
    path.write_text(HEADER + "".join(f"{name}=={version}\n" for name, version in pins.items()))
    return pins


def _minor(text: str) -> str:
    return ".".join(text.split("+")[0].split(".")[:2])


def widen(installed: dict[str, str], compat: Path = COMPAT, pyproject: Path = PYPROJECT) -> list[str]:
    """Raise compat.CHECKED's newest to the installed minor where it is newer, and pyproject's upper bounds
    with it (newest + one minor). Returns what changed, one line each."""
    changed = []
    source, project = compat.read_text(), pyproject.read_text()
    for lib, oldest, newest in re.findall(r'^    "([\w-]+)": \("([\d.]+)", "([\d.]+)"\),$', source, re.M):
        if lib not in installed:
            continue
        now = _minor(installed[lib])
        if tuple(map(int, now.split("."))) <= tuple(map(int, newest.split("."))):
            continue
        source = source.replace(f'    "{lib}": ("{oldest}", "{newest}"),', f'    "{lib}": ("{oldest}", "{now}"),')
        major, minor = map(int, now.split("."))
        project = re.sub(rf'"{lib}>={re.escape(oldest)},<[\d.]+"', f'"{lib}>={oldest},<{major}.{minor + 1}"', project)
        changed.append(f"{lib}: checked {oldest} to {newest} -> {oldest} to {now}")
    compat.write_text(source)
    pyproject.write_text(project)
    return changed


def upgrade() -> int:
    """A fresh venv with the newest releases, past pyproject's upper bounds (the bounds are what this step
    moves); the suite in it; on green the lock is written from it and compat's ranges widened."""
    with tempfile.TemporaryDirectory(prefix="finetune-upgrade-") as tmp:
        venv = Path(tmp) / "venv"
        py = str(venv / "bin" / "python")
        pip = [py, "-m", "pip", "install", "-q", "--upgrade-strategy", "eager"]
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, f"torch=={TORCH}", "-e", f"{ROOT}[dev,ui]"], check=True)
        bounded = [lib for lib in re.findall(r'^    "([\w-]+)": \(', COMPAT.read_text(), re.M) if lib != "torch"]
        subprocess.run([*pip, "--upgrade", *bounded], check=True)  # pip says it conflicts; that is the point
        kept = {path: path.read_text() for path in (LOCK, COMPAT, PYPROJECT)}
        subprocess.run([py, __file__, "freeze"], check=True)
        for line in widen(read_lock(LOCK), COMPAT, PYPROJECT):
            print(f"upgrade: {line}")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        suite = subprocess.run([py, "-m", "pytest", "-q", "-n", "auto", "-p", "no:cacheprovider"], cwd=ROOT, env=env)
    if suite.returncode != 0:
        for path, text in kept.items():
            path.write_text(text)
        print("upgrade: the suite failed on the newest releases; lock, compat and pyproject are as they were",
              file=sys.stderr)
        return 1
    print("upgrade: the suite passed; commit the lock, compat.py and pyproject.toml, and sync .venv with the "
          "README's install command")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("freeze", "check", "upgrade"))
    parser.add_argument("--print", action="store_true", help="freeze: print the pins instead of writing the lock")
    args = parser.parse_args(argv)
    if args.command == "freeze":
        if args.print:
            print("\n".join(f"{k}=={v}" for k, v in closure().items()))
            return 0
        print(f"lock: {len(freeze())} packages in {LOCK.relative_to(ROOT)}")
        return 0
    if args.command == "check":
        lines = drift(read_lock()) + torch_copies()
        print("\n".join(lines) or f"lock: installed versions equal the lock; each torch written is {TORCH}")
        return 1 if lines else 0
    return upgrade()


if __name__ == "__main__":
    sys.exit(main())
