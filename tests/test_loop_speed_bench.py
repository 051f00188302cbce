"""benchmarks/loop_speed.py (issue #27): `finetune run` and TRL's SFTTrainer + PEFT timed side by side; here on
the tiny model, 2 steps, so the plumbing (subprocess per variant, stamps, same tokens, the table) is checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.loop_speed import table

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_times_finetune_and_trl_on_the_same_tokens(tiny_model_dir, tmp_path):
    out = tmp_path / "loop_speed.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loop_speed.py"), "--smoke",
                           "--model", str(tiny_model_dir), "--out", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# python ") and "--smoke" in text.splitlines()[0]
    rows = {m[0]: m[1:] for m in re.findall(
        r"^\s+(current|trl)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
        text, re.M)}
    assert set(rows) == {"current", "trl"}, text
    for name, (tokens, loss, *times) in rows.items():
        assert float(tokens) > 0 and float(loss) > 0, name
        assert all(float(v) > 0 for v in times), (name, times)
    assert rows["current"][0] == rows["trl"][0]  # tokens per step
    assert rows["current"][1] == rows["trl"][1]  # loss of step 1: same weights, LoRA init and examples
    assert float(rows["trl"][4]) == 1.0  # the only baseline is its own reference
    assert "Candidate current:" in text


def test_variants_on_different_batches_are_refused():
    rows = {"new": [{"wall": 1.0, "cpu": 1.0, "tokens": 400.0, "loss": 2.0}],
            "trl": [{"wall": 1.0, "cpu": 1.0, "tokens": 410.0, "loss": 2.0}]}
    with pytest.raises(SystemExit, match="tokens per timed step differ by more than 1%"):
        table(rows, "new")


def test_ratios_are_to_the_fastest_baseline():
    def runs(*cpu):
        return [{"wall": 2 * c, "cpu": c, "tokens": 400.0, "loss": 2.0} for c in cpu]

    lines = table({"old": runs(3.0, 2.0, 2.2), "new": runs(1.8, 1.9, 5.0), "trl": runs(2.4, 2.5, 2.6)}, "new")
    new = next(line.split() for line in lines if line.split()[0] == "new")
    assert float(new[5]) == pytest.approx(1.9 / 2.2, abs=1e-3)  # median over old's median (the faster baseline)
    assert "cpu: old" in lines[-1] and "target met" in lines[-1]
