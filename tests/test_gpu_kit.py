"""The GPU kit (benchmarks/gpu) never rots: its CPU dry run goes through every stage, and random:FOLDER models
load through the real loader, quantized as the recipe says."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.errors import RecipeError

REPO = Path(__file__).resolve().parents[1]


def _run_kit(out: Path, *args: str, rc: int = 0) -> subprocess.CompletedProcess:
    """benchmarks/gpu/run.sh --cpu OUT ARGS, as a GPU call runs it (no wheels here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "WHEELS": str(out / "no-wheels")}
    proc = subprocess.run(["bash", str(REPO / "benchmarks/gpu/run.sh"), "--cpu", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


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
    assert set(stages) == {"env", "a", "b", "c", "d"}
    assert all(stages[k]["status"] == "done" for k in ("env", "a", "b", "c")), {k: v["status"] for k, v in stages.items()}
    assert stages["env"]["rows"][0]["checks"]["bitsandbytes 4-bit"] == "ok on cpu"
    assert stages["d"]["status"].startswith("not run"), "unsloth is not installed in the test environment"
    md = (dry_run / "results.md").read_text()
    for header in ("predicted_bytes", "measured_reserved_bytes", "measured_allocated_bytes", "error_reserved",
                   "predicted_max_tokens", "trained_max_tokens", "hf_peft_tokens_per_s", "trl_tokens_per_s",
                   "predicted_tokens_per_s"):
        assert header in md


def test_planner_vs_measured_rows(dry_run):
    rows = json.loads((dry_run / "results.json").read_text())["stages"]["a"]["rows"]
    assert len(rows) >= 9
    for row in rows:
        assert row["status"] == "completed", row
        assert _finite(row["predicted_bytes"]) and _finite(row["measured_allocated_bytes"]), row
        assert abs(row["error_allocated"]) <= 0.07, row  # the target, on the CPU tracker
        assert row["predicted_tokens_per_s"] > 0 and row["tokens_per_s"] > 0, row  # the speed model beside it
    text = [r for r in rows if "real data" not in r["name"] and r["data"]["format"] == "text"]
    # Synthetic batches are exactly max_seq_len long: every record was cut to it.
    assert text and all(r["data"]["truncated"] == r["data"]["records_used"] for r in text)
    # Real records: one cut to max_seq_len and one shorter, padded to it: the padded batch the plan prices.
    real, = [r for r in rows if "real data" in r["name"]]
    assert real["data"]["truncated"] == 1 and real["data"]["records_used"] == 2, real["data"]
    assert real["data"]["max_example_tokens"] == real["max_seq_len"] > real["data"]["train_tokens"] / 2, real["data"]
    grpo, = [r for r in rows if r["data"]["format"] == "prompt"]  # generation and training planned together
    assert grpo["predicted_bytes"] == max(grpo["predicted_generation_bytes"], grpo["predicted_training_bytes"])
    assert grpo["generation_tokens_per_s"] > 0 and grpo["training_tokens_per_s"] > 0 and grpo["tokens_per_s"] > 0


def test_max_context_and_speed_rows(dry_run):
    stages = json.loads((dry_run / "results.json").read_text())["stages"]
    (b,) = stages["b"]["rows"]
    assert _finite(b["predicted_max_tokens"]) and _finite(b["trained_max_tokens"])
    assert b["probes"] and b["probes"][str(b["trained_max_tokens"])] == "ok"
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


def test_random_weights_folder_needs_config(tmp_path, capsys):
    """A user error (exit 2) in one line naming the key and the missing file, from `--set` as from the recipe."""
    from finetune.cli import main
    from finetune.model.source import resolve_model_path

    with pytest.raises(RecipeError, match=f"model.path: random:{tmp_path}: {tmp_path / 'config.json'} does not exist"):
        resolve_model_path(f"random:{tmp_path}")
    recipe = Path(__file__).parents[1] / "recipes" / "quickstart.yaml"
    for folder, missing in ((tmp_path, tmp_path / "config.json"), (tmp_path / "nowhere", f"the folder {tmp_path}/nowhere")):
        assert main(["validate", str(recipe), "--set", f"model.path=random:{folder}"]) == 2
        err = capsys.readouterr().err
        assert err.splitlines()[0] == f"error: model.path: random:{folder}: {missing} does not exist", err
        assert "Traceback" not in err


def test_first_lease_continues_across_calls_and_merges(tmp_path):
    """The --first-lease plan split as a timed-out call splits it: a call stopped by its time limit, its
    results.json merged into the kept folder, a second call from the kept copy finishing the plan: every row
    in the plan's order, each with its own seconds beside its estimate, the 8B rows on one loaded model."""
    from benchmarks.gpu import first_lease
    from benchmarks.gpu.results import merge_into

    kept, call = tmp_path / "kept", tmp_path / "call"
    stopped = _run_kit(call, "--first-lease", "--time-limit", "1").stdout  # the environment check only
    assert re.search(r"first lease: 16 rows left, estimated \d+ s: a second call with --time-limit", stopped)
    first = json.loads((call / "results.json").read_text())
    assert [r["name"] for r in first["stages"]["env"]["rows"]] == ["environment"]
    assert first["stages"]["env"]["rows"][0]["status"] == "ok"
    assert first["stages"]["env"]["rows"][0]["checks"]["carried versions"].startswith("ok")
    assert all(first["stages"][k]["status"].startswith("partial") for k in "abc"), first["stages"]
    assert not any(first["stages"][k]["rows"] for k in "abc")
    merge_into(call / "results.json", kept)
    call.joinpath("results.json").write_text((kept / "results.json").read_text())  # the next call starts from it
    printed = _run_kit(call, "--first-lease").stdout
    merge_into(call / "results.json", kept)
    data = json.loads((kept / "results.json").read_text())
    assert len(data["calls"]) == 2 and all(c["seconds"] > 0 for c in data["calls"])
    stages = data["stages"]
    plan = first_lease.rows()
    for stage in ("env", "a", "b", "c"):  # every row of the plan, in its order
        assert [r["name"] for r in stages[stage]["rows"]] == [r.name for r in plan if r.stage == stage], stage
    measured = [r for s in "abc" for r in stages[s]["rows"]]
    assert all(r["seconds"] >= 0 and r["estimated_s"] >= 0 for r in measured)
    assert first_lease.MOE_ROW in [r["name"] for r in stages["a"]["rows"]]  # on the smallest MoE fixture config
    assert all(r["status"] == "completed" for r in stages["a"]["rows"])
    assert any("full paged_adamw_8bit" in r["name"] for r in stages["a"]["rows"])
    assert stages["c"]["rows"][0]["vs_hf_peft"] > 0  # finetune run vs HF Trainer + PEFT on the lent model
    assert "first lease: every row measured; no second call needed" in printed
    (b,) = stages["b"]["rows"]
    assert b["status"] == "done" and b["trained_max_tokens"] > 0 and len(b["probes"]) <= 3 == b["max_probes"]
    assert all(r["attempts"] == 1 for s in ("a", "b", "c") for r in stages[s]["rows"])  # nothing measured twice
    assert "| environment | ok |" in (kept / "results.md").read_text()
    # The planned order, printed with each row's estimated H100 seconds, within the 420 s of work.
    lines = printed[printed.index("first lease:"):].splitlines()
    table = [re.match(r"\s*(\d+)\s+([\d.]+)\s+(\w+)\s+(.+)$", line) for line in lines[2:2 + len(plan)]]
    assert [m.group(4) for m in table] == [r.name for r in plan]
    total = float(re.search(r"estimated (\d+) s", lines[0]).group(1))
    assert abs(total - sum(float(m.group(2)) for m in table)) <= 1 and total <= first_lease.WORK_LIMIT_S == 420
    assert all(float(m.group(2)) > 0 for m in table if m.group(4) != first_lease.MOE_ROW)


def test_a_first_lease_over_its_work_limit_is_refused(tmp_path, capsys):
    """A plan whose estimate exceeds the limit is refused before anything runs, in one line, exit code 2."""
    from benchmarks.gpu import configs, first_lease

    more = first_lease.rows() + [first_lease.Row(c["name"], "a", "train", c) for c in configs.stage_a()[:6]]
    with pytest.raises(first_lease.PlanRefused) as refused:
        first_lease.check_plan(more)
    line = str(refused.value)
    assert "\n" not in line and re.search(r"estimated \d+ s of H100 work exceed 420 s", line), line
    assert sum(first_lease.estimate(r) for r in more) > 420
    from benchmarks.gpu.suite import main

    assert main([str(tmp_path), "--cpu", "--first-lease", "--work-limit", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("first lease refused: ") and err.count("\n") == 1 and "exceed 100 s" in err, err
    assert not (tmp_path / "results.json").exists()


def test_the_time_model_prices_what_costs_more_higher():
    """The estimates follow FLOPs, bytes and load: longer sequences, a full fine-tune's extra backward,
    offload's link (disk slower than host), GRPO's generation and the 8B load cost more."""
    from benchmarks.gpu import configs, first_lease

    by_name = {c["name"]: c for c in configs.stage_a()}
    step = first_lease.step_seconds
    assert step(by_name["Llama-3.1-8B QLoRA 8k"]) > 3 * step(by_name["Llama-3.1-8B QLoRA 2k"]) - 3 * first_lease.STEP_OVERHEAD_S
    q = "Qwen2.5-0.5B QLoRA 8k"
    assert step(by_name[f"{q} offload disk"]) > step(by_name[f"{q} offload cpu"]) > step(by_name[f"{q} chunked loss"])
    assert step(by_name["Qwen2.5-0.5B full adamw_8bit"]) > step({**by_name["Qwen2.5-0.5B full adamw_8bit"],
                                                               "keys": {**configs.LORA_BF16, **configs.PLAIN}})
    assert first_lease.load_seconds(configs.LLAMA) > 10 * (first_lease.load_seconds(configs.QWEN05) - first_lease.LOAD_FIXED_S)
    rows = {r.name: first_lease.estimate(r) for r in first_lease.rows()}
    assert rows[configs.GRPO_ROW] > rows["Qwen2.5-0.5B QLoRA 4k"]


def test_the_environment_check_names_a_package_at_another_version():
    """On the GPU machine the kit checks first that every carried package is the one Python imports; a
    package at another version fails the check naming it (the suite then stops the call, exit code 1)."""
    from benchmarks.gpu import first_lease

    pins = first_lease.carried_pins()
    assert {"transformers", "peft", "bitsandbytes", "trl", "datasets", "liger-kernel"} <= set(pins)
    # this environment has the pinned versions (Liger, the cuda extra, where it is installed: CUDA machines)
    pins = {name: v for name, v in pins.items() if name not in first_lease.cuda_extra()}
    assert first_lease.version_problems(pins) == []
    (problem,) = first_lease.version_problems({**pins, "peft": "0.0.1"})
    assert problem.startswith("peft 0.21.2") and "the kit carried 0.0.1" in problem
    assert first_lease.version_problems({"no-such-package": "1.0"}) == ["no-such-package: not importable; the kit carried 1.0"]
    row = first_lease.environment_row({}, pins={"peft": "0.0.1"})
    assert row["status"].startswith("error: carried versions") and "peft" in row["checks"]["carried versions"]
    # The image's own packages are recorded where they differ from its listing, without failing the row.
    assert first_lease.image_differences({"peft": "0.0.1", "no-such-package": "1.0"}) == ["peft 0.21.2 (listed 0.0.1)"]


def test_a_package_at_another_version_stops_the_call(tmp_path, monkeypatch):
    """The suite's environment check is the first thing a call runs; a carried package imported at another
    version ends the call there (exit 1), naming the package, with the row saved."""
    from benchmarks.gpu import first_lease, suite

    monkeypatch.setattr(first_lease, "carried_pins", lambda: {"peft": "0.0.1"})
    kit = suite.Suite(tmp_path / "out", cpu=True, time_limit=600, work=tmp_path / "work")
    with pytest.raises(SystemExit, match=r"^environment check failed: peft 0\.21\.2 .* the kit carried 0\.0\.1$"):
        kit.stage_env()
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["stages"]["env"]["rows"]
    assert row["status"] == "error: carried versions"


def test_a_recovered_oom_is_reported_as_a_plan_failure(tmp_path, monkeypatch):
    """finetune's OOM recovery lets the run finish with a cheaper plan and re-plans plan.json: the row still
    fails (status "oom recovered", the event with its error) and is judged on the plan the run started with."""
    from benchmarks.gpu import configs, suite
    from finetune.plan import predict
    from finetune.train.recovery import FAULT_ENV

    kit = suite.Suite(tmp_path / "out", cpu=True, time_limit=600, work=tmp_path / "work")
    cfg = next(c for c in configs.stage_a_cpu() if c["name"] == "Llama-3.1-8B QLoRA 2k mb2 acc4")
    recipe = kit.recipe(cfg, 3, tmp_path / "run")
    monkeypatch.setenv(FAULT_ENV, "2")
    row = {"name": cfg["name"], **kit.train(recipe)}
    assert row["status"] == "oom recovered" and row["error_kind"] == "oom"
    (event,) = row["oom_events"]
    assert event["event"] == "oom_recovered" and event["oom_step"] == 2 and "injected" in event["error"]
    assert event["to"]["micro_batch_size"] == 1
    assert row["predicted_bytes"] == predict(recipe).peak_bytes and row["fits"] is True  # the plan at mb 2
    assert row["settings"]["micro_batch_size"] == 2
    kit.put("a", row)
    kit.summarize_a()
    assert cfg["name"] in kit.results.data["stages"]["a"]["summary"]["plans that fit but OOMed or failed"]


def test_error_kinds_and_retries():
    import torch

    from benchmarks.gpu.suite import again, error_record
    from finetune.errors import FinetuneError

    assert error_record(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))["error_kind"] == "oom"
    assert error_record(FinetuneError("out of memory at step 2 with the leanest settings left"))["status"] == "oom"
    bug = error_record(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert bug["status"] == bug["error_kind"] == "error" and "illegal memory access" in bug["error"]
    assert again({"status": "error", "error_kind": "error", "attempts": 1})  # a bug may be transient: once more
    assert not again({"status": "error", "error_kind": "error", "attempts": 2})
    assert not again({"status": "oom", "error_kind": "oom", "attempts": 1})  # an OOM is a result
    assert again({"status": "partial"})


def test_a_probe_that_fails_with_an_error_is_not_counted_as_oom(tmp_path, monkeypatch):
    """Stage b: a probe broken by an error (say a CUDA-path bug) is recorded as an error with its text, not
    as a length that ran out of memory, and a later call probes it again."""
    from benchmarks.gpu import suite

    kit = suite.Suite(tmp_path / "out", cpu=True, time_limit=600, work=tmp_path / "work")
    broken = {"status": "error", "error_kind": "error", "error": "RuntimeError: CUDA error: misaligned address",
              "seconds": 0.1}
    monkeypatch.setattr(suite.Suite, "train", lambda self, recipe, memory_cap=None, base=None: dict(broken))
    kit.stage_b([8])
    (row,) = kit.results.data["stages"]["b"]["rows"]
    assert row["trained_max_tokens"] == 0 and set(row["probes"].values()) == {"error"}
    assert all("misaligned address" in text for text in row["errors"].values())
    calls = []
    monkeypatch.setattr(suite.Suite, "train", lambda self, recipe, memory_cap=None, base=None: calls.append(1) or dict(broken))
    kit.stage_b([8])
    assert calls, "the errored probes were not tried again"
    assert kit.results.data["stages"]["b"]["rows"][0]["attempts"] == 2
    calls.clear()
    kit.stage_b([8])
    assert not calls, "tried more than ATTEMPTS times"


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0]).lower()


def test_the_wheels_plan_covers_what_the_gpu_image_lacks():
    """Every need of the project and of each carried wheel is met by a carried wheel or the image's
    package list (KINDS.md), carried pins are the versions tested here, and a carried wheel that the image
    also has is there for a version reason (transformers 5.17 lacks activation_checkpointing; transformers 5.25
    needs huggingface-hub >= 2.4, the image has 1.33)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    from benchmarks.gpu.first_lease import carried_pins, cuda_extra, image_packages

    carried = carried_pins()
    image = image_packages()
    # The cuda extra (Liger) is carried at the lock's pin (tests/test_lock.py) and checked on the GPU by the
    # kit's environment row; on a CPU install it is absent, and with it the metadata its needs are read from.
    cuda_only = {n for n in carried if _name(n) in cuda_extra()}
    assert cuda_only == {"liger-kernel"}
    installed = {n for n in carried if n not in cuda_only or importlib.util.find_spec(n.replace("-", "_"))}
    for name in installed:
        version = carried[name]
        assert md.version(name) == version, f"wheels.sh pins {name}=={version}; the project is tested with {md.version(name)}"
    assert {_name(n) for n in carried} & set(image) == {"transformers", "peft", "huggingface-hub"}
    project = (REPO / "pyproject.toml").read_text()
    needs = re.findall(r'^  "([^"]+)"', project[project.index("dependencies = ["):project.index("\n]")], re.M)
    gpu_python = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_machine": "x86_64", "platform_python_implementation": "CPython", "extra": ""}
    needs += [r for n in installed for r in md.requires(n) or []
              if Requirement(r).marker is None or Requirement(r).marker.evaluate(gpu_python)]
    missing = sorted({_name(r) for r in needs} - set(image) - {_name(n) for n in carried})
    assert not missing, f"neither on the GPU image nor carried by wheels.sh: {missing}"
    for requirement in map(Requirement, needs):  # what the image has, where its version is known, is enough
        name = _name(requirement.name)
        if name not in {_name(n) for n in carried} and image[name]:
            assert requirement.specifier.contains(image[name], prereleases=True), (str(requirement), image[name])


def test_merge_keeps_rows_a_call_did_not_have():
    """A call that started from an older copy (its kept file was not merged yet) adds to the kept rows and
    replaces the ones it measured again; each call is recorded once."""
    from benchmarks.gpu.results import merge

    def stage(status, *rows):
        return {"title": "a", "status": status, "summary": {}, "rows": [{"name": n, "status": s} for n, s in rows]}

    one = {"device": "gpu", "seconds": 500.0, "rows": 2}
    kept = {"runs": 2, "calls": [one], "stages": {"a": stage("partial", ("x", "completed"), ("y", "error"))}}
    new = {"runs": 2, "calls": [{**one, "seconds": 400.0}], "stages": {
        "a": stage("done", ("y", "completed"), ("z", "oom")), "b": stage("not run")}}
    merged = merge(new, kept)
    assert [(r["name"], r["status"]) for r in merged["stages"]["a"]["rows"]] == [
        ("x", "completed"), ("y", "completed"), ("z", "oom")]
    assert merged["stages"]["a"]["status"] == "done" and merged["stages"]["b"]["status"] == "not run"
    assert [c["seconds"] for c in merged["calls"]] == [500.0, 400.0]
    assert merge(new, merged)["calls"] == merged["calls"]  # merging the same call twice adds nothing


def test_a_run_that_fails_before_its_first_step_keeps_its_prediction(tmp_path):
    """finetune run removes the folder of a run that trained nothing (plan.json with it): the row still carries
    the plan it was judged on, so a plan that fits but fails on load reads as a plan failure."""
    from benchmarks.gpu import configs, suite
    from finetune.plan import predict

    kit = suite.Suite(tmp_path / "out", cpu=True, time_limit=600, work=tmp_path / "work")
    cfg = next(c for c in configs.stage_a_cpu() if c["name"] == "Llama-3.1-8B QLoRA 2k mb2 acc4")
    recipe = kit.recipe(cfg, 3, tmp_path / "run")
    recipe = recipe.model_copy(update={"memory": recipe.memory.model_copy(update={"kernels": "liger",
                                                                                  "chunked_loss": False})})
    row = kit.train(recipe)  # memory.kernels: liger is refused on CPU (api.preflight), before the first step
    assert row["status"] == "error" and "memory.kernels" in row["error"]
    assert not (tmp_path / "run").exists()
    assert row["predicted_bytes"] == predict(recipe).peak_bytes and row["fits"] is True
