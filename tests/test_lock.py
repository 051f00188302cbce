"""The lock file (finetune/constraints.txt): the versions the suite passed on, read by every install, equal to
what is installed here, and moved together with compat's checked ranges and pyproject's bounds."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from finetune import compat

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lock_tool", ROOT / ".ci" / "lock.py")
lock_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock_tool)


def test_installed_versions_equal_the_lock():
    """Drift shows as drift: a red line here names each package whose installed version is not the lock's
    (a new release picked up by hand, or a lock not rewritten after an upgrade)."""
    pins = lock_tool.read_lock()
    assert len(pins) > 50 and "transformers" in pins and "torch" not in pins
    assert lock_tool.drift(pins) == []


def test_drift_names_every_package_that_differs(tmp_path):
    fake = tmp_path / "constraints.txt"
    rich = lock_tool.read_lock()["rich"]
    fake.write_text(f"# comment\ntransformers==0.0.1\nno-such-package==1.0\nrich=={rich}\n")
    import importlib.metadata as md

    assert lock_tool.drift(lock_tool.read_lock(fake)) == [
        f"transformers {md.version('transformers')} installed, lock has 0.0.1",
        "no-such-package not installed installed, lock has 1.0"]


def test_an_optional_package_drifts_only_where_it_is_installed():
    """Liger is absent from a CPU install (no drift), and at another version than the lock's where installed."""
    import importlib.metadata as md

    try:
        installed = md.version("liger-kernel")
    except md.PackageNotFoundError:
        installed = None
    lines = lock_tool.drift({"liger-kernel": "0.0.1"})
    assert lines == ([] if installed is None else [f"liger-kernel {installed} installed, lock has 0.0.1"])


def test_the_lock_holds_the_whole_dependency_tree_and_nothing_else():
    """Written from the environment, not by hand: a dependency added to pyproject without `freeze` fails here.
    The cuda extra's own package (Liger Kernel, installed on CUDA machines only) is pinned too."""
    assert lock_tool.optional_names() == {"liger-kernel"}
    assert set(lock_tool.closure()) | lock_tool.optional_names() == set(lock_tool.read_lock())
    assert compat.tested_versions() == lock_tool.read_lock()  # the copy the package reads at run time


def _project_requirements(text: str) -> dict[str, Requirement]:
    block = text[text.index("dependencies = ["):text.index("\n]")]
    return {Requirement(r).name: Requirement(r) for r in re.findall(r'^  "([^"]+)"', block, re.M)}


def _bounds_agree(compat_source: str, pyproject: str) -> list[str]:
    checked = dict((lib, (lo, hi)) for lib, lo, hi in
                   re.findall(r'^    "([\w-]+)": \("([\d.]+)", "([\d.]+)"\),$', compat_source, re.M))
    reqs = _project_requirements(pyproject)
    problems = []
    for lib, (oldest, newest) in checked.items():
        major, minor = map(int, newest.split("."))
        want = {f">={oldest}"} | (set() if lib == "torch" else {f"<{major}.{minor + 1}"})
        have = {str(s) for s in reqs[lib].specifier}
        if have != want:
            problems.append(f"{lib}: pyproject {sorted(have)}, compat.CHECKED says {sorted(want)}")
    return problems


def test_pyproject_bounds_come_from_compats_checked_table():
    """One table: pyproject's floor is the oldest checked minor and its ceiling the next minor after the newest
    (torch: no ceiling, a GPU user's CUDA build is theirs); the lock's versions lie inside the checked range."""
    assert _bounds_agree((ROOT / "finetune" / "compat.py").read_text(), (ROOT / "pyproject.toml").read_text()) == []
    pins = lock_tool.read_lock()
    for lib in compat.CHECKED:
        if lib in pins:
            assert compat.PrivateAPI("", lib).checked(pins[lib]), (lib, pins[lib], compat.CHECKED[lib])


def test_upgrade_widens_compat_and_pyproject_together(tmp_path):
    compat_copy, project_copy = tmp_path / "compat.py", tmp_path / "pyproject.toml"
    shutil.copy(ROOT / "finetune" / "compat.py", compat_copy)
    shutil.copy(ROOT / "pyproject.toml", project_copy)
    oldest, newest = compat.CHECKED["transformers"]
    major, minor = map(int, newest.split("."))
    newer = f"{major}.{minor + 2}.1"
    changed = lock_tool.widen({"transformers": newer, "accelerate": "0.1.0"}, compat_copy, project_copy)
    assert changed == [f"transformers: checked {oldest} to {newest} -> {oldest} to {major}.{minor + 2}"]
    assert f'"transformers": ("{oldest}", "{major}.{minor + 2}"),' in compat_copy.read_text()
    assert f'"transformers>={oldest},<{major}.{minor + 3}"' in project_copy.read_text()
    assert _bounds_agree(compat_copy.read_text(), project_copy.read_text()) == []


@pytest.mark.parametrize(("path", "needle"), [
    ("README.md", f".venv/bin/pip install torch=={lock_tool.TORCH} -c finetune/constraints.txt -e"),
    ("docker/Dockerfile", "--constraint finetune/constraints.txt"),
    (".ci/run", 'run ".venv/bin/python .ci/lock.py check"'),  # after the README's install: drift named first
])
def test_every_install_reads_the_lock(path, needle):
    assert needle in (ROOT / path).read_text()


def test_every_torch_version_written_is_the_lock_tools():
    """One torch version: the README's install, the Docker base and stand-in, docker/test.sh, pyproject's and the
    docs' prose all say .ci/lock.py's TORCH (a copy that differs is named by file and line)."""
    assert lock_tool.torch_copies() == []
    assert f"torch=={lock_tool.TORCH} " in (ROOT / "README.md").read_text()  # the command CI runs pins it


def test_a_torch_copy_that_differs_is_named_by_file_and_line(tmp_path):
    """A checkout with one copy moved (the Docker base) and one left behind (docker/test.sh): only the one that
    differs is named; a record of what ran (benchmarks/results) and another package's version are not."""
    other = "2.12.1" if lock_tool.TORCH != "2.12.1" else "2.11.0"
    files = {"docker/Dockerfile": f"# torch {lock_tool.TORCH}\nARG BASE=pytorch/pytorch:{lock_tool.TORCH}-cuda13.0\n",
             "docker/test.sh": f"set -e\n\nTORCH={other}\n",
             "benchmarks/results/old.txt": f"torch {other}+cpu\n",
             "finetune/constraints.txt": f"apollo-torch=={other}\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    assert lock_tool.torch_copies(tmp_path) == [f"docker/test.sh:3: torch {other}, .ci/lock.py's TORCH is "
                                                f"{lock_tool.TORCH}"]


def test_the_gpu_kits_wheels_are_the_locks_versions():
    from benchmarks.gpu.first_lease import carried_pins

    carried, pins = carried_pins(), lock_tool.read_lock()
    assert carried and all(pins.get(lock_tool.normalize(n)) == v for n, v in carried.items()), carried


def test_wheels_sh_downloads_the_locks_pins(tmp_path):
    """The GPU kit's download itself (benchmarks/gpu/wheels.sh, run with a stand-in Python that records its
    `pip download` and stops there): every wheel it asks for is pinned at the lock's version, none without one."""
    import os

    record = tmp_path / "args"
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\nexit 3\n')
    stub.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "wheels.sh"), str(tmp_path / "whl")],
                          env={**os.environ, "PYTHON": str(stub)}, capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr  # stopped at the stand-in's download, after the pins were read
    args = record.read_text().splitlines()
    assert args[:3] == ["-m", "pip", "download"]
    wanted = args[args.index(str(tmp_path / "whl")) + 1:]
    assert len(wanted) > 10 and all("==" in a for a in wanted), wanted
    pins = lock_tool.read_lock()
    differ = [a for a in wanted if pins.get(lock_tool.normalize(a.split("==")[0])) != a.split("==")[1]]
    assert differ == [], f"wheels.sh downloads {differ}; the lock's: {[pins.get(lock_tool.normalize(a.split('==')[0])) for a in differ]}"


@pytest.mark.parametrize("suite", [0, 1])
def test_upgrade_keeps_the_new_versions_only_where_the_suite_passes(tmp_path, monkeypatch, capsys, suite):
    """`upgrade`, its venv, pip and suite stood in for: the newest releases' lock is written and compat's range
    and pyproject's bound widened before the suite runs in the new venv (which checks them); red puts the three
    files back as they were, green keeps them."""
    files = {}
    for name, source in (("lock", lock_tool.LOCK), ("compat", lock_tool.COMPAT), ("pyproject", lock_tool.PYPROJECT)):
        files[name] = tmp_path / source.name
        shutil.copy(source, files[name])
        monkeypatch.setattr(lock_tool, name.upper(), files[name])
    before = {name: path.read_text() for name, path in files.items()}
    oldest, newest = compat.CHECKED["transformers"]
    major, minor = map(int, newest.split("."))
    newer = f"{major}.{minor + 1}.0"
    calls = []

    def run(args, **kwargs):
        calls.append(args)
        if args[1:] == [lock_tool.__file__, "freeze"]:  # the new venv writes the lock from its newest releases
            files["lock"].write_text(before["lock"].replace(f"transformers=={lock_tool.read_lock()['transformers']}",
                                                            f"transformers=={newer}"))
        if "pytest" in args:
            assert f'"transformers": ("{oldest}", "{major}.{minor + 1}"),' in files["compat"].read_text()
        return subprocess.CompletedProcess(args, suite if "pytest" in args else 0)

    monkeypatch.setattr(lock_tool.subprocess, "run", run)
    assert lock_tool.upgrade() == suite
    assert any("pytest" in c for c in calls) and any("--upgrade" in c and "transformers" in c for c in calls)
    after = {name: path.read_text() for name, path in files.items()}
    if suite:
        assert after == before and "lock, compat and pyproject are as they were" in capsys.readouterr().err
    else:
        assert f"transformers=={newer}" in after["lock"]
        assert f'"transformers>={oldest},<{major}.{minor + 2}"' in after["pyproject"]
        assert _bounds_agree(after["compat"], after["pyproject"]) == []
