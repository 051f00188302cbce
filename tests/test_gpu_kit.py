"""The GPU kit (benchmarks/gpu) never rots: its CPU dry run goes through every stage, and random:FOLDER models
load through the real loader, quantized as the recipe says."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.errors import ModelLoadError

REPO = Path(__file__).resolve().parents[1]


def _run_kit(out: Path, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "WHEELS": str(out / "no-wheels")}
    proc = subprocess.run(["bash", str(REPO / "benchmarks/gpu/run.sh"), "--cpu", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-kit")
    _run_kit(out)
    return out


def test_dry_run_writes_every_stage(dry_run):
    data = json.loads((dry_run / "results.json").read_text())
    stages = data["stages"]
    assert set(stages) == {"a", "b", "c", "d"}
    assert all(stages[k]["status"] == "done" for k in "abc"), {k: v["status"] for k, v in stages.items()}
    assert stages["d"]["status"].startswith("not run"), "unsloth is not installed in the test environment"
    md = (dry_run / "results.md").read_text()
    for header in ("predicted_bytes", "measured_reserved_bytes", "measured_allocated_bytes", "error_reserved",
                   "predicted_max_tokens", "trained_max_tokens", "hf_peft_tokens_per_s", "trl_tokens_per_s"):
        assert header in md


def test_planner_vs_measured_rows(dry_run):
    rows = json.loads((dry_run / "results.json").read_text())["stages"]["a"]["rows"]
    assert len(rows) >= 9
    for row in rows:
        assert row["status"] == "completed", row
        assert _finite(row["predicted_bytes"]) and _finite(row["measured_allocated_bytes"]), row
        assert abs(row["error_allocated"]) <= 0.07, row  # the target, on the CPU tracker
    synthetic = [r for r in rows if "real data" not in r["name"]]
    # Synthetic batches are exactly max_seq_len long: every record was cut to it.
    assert all(r["data"]["truncated"] == r["data"]["records_used"] for r in synthetic)


def test_max_context_and_speed_rows(dry_run):
    stages = json.loads((dry_run / "results.json").read_text())["stages"]
    (b,) = stages["b"]["rows"]
    assert _finite(b["predicted_max_tokens"]) and _finite(b["trained_max_tokens"])
    assert b["probes"] and b["probes"][str(b["trained_max_tokens"])] is True
    speed = stages["c"]["rows"][0]
    assert all(_finite(speed[k]) for k in ("finetune_tokens_per_s", "hf_peft_tokens_per_s", "trl_tokens_per_s"))
    overheads = [r for r in stages["c"]["rows"][1:] if "checkpointing alone" not in r["name"]]
    assert len(overheads) == 4 and all(math.isfinite(r["overhead"]) for r in overheads)


def test_second_call_resumes(dry_run):
    from benchmarks.gpu.suite import main

    before = json.loads((dry_run / "results.json").read_text())
    assert main([str(dry_run), "--cpu", "--stage", "a,d"]) == 0
    after = json.loads((dry_run / "results.json").read_text())
    assert after["runs"] == before["runs"] + 1
    assert after["stages"]["a"]["rows"] == before["stages"]["a"]["rows"]  # nothing measured twice


def test_random_weights_model_loads_quantized(tmp_path):
    import torch

    from finetune.model.load import load_model
    from finetune.plan.shapes import load_model_config
    from finetune.recipe.schema import ModelConfig, QuantizationConfig
    from finetune.testing import make_tokenizer, tiny_config

    make_tokenizer().save_pretrained(tmp_path)
    tiny_config("qwen2", tie_word_embeddings=True).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    path = f"random:{tmp_path}"
    assert load_model_config(path).hidden_size == 64
    model, tokenizer, _ = load_model(ModelConfig(path=path), QuantizationConfig(bits=4))
    import bitsandbytes as bnb

    assert isinstance(model.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert 0.1 < model.model.embed_tokens.weight.float().std().item() < 0.3  # initializer_range 0.2
    ids = torch.tensor([tokenizer.encode("the quick brown fox")])
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_random_weights_folder_needs_config(tmp_path):
    from finetune.model.source import resolve_model_path

    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_path(f"random:{tmp_path}")
