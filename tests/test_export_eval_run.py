"""A trained run through the commands: `finetune export --format gguf --ollama` writes one GGUF file whose
logits equal the merged safetensors export's, an interrupted export leaves nothing behind, and `finetune eval`
measures the run against its base model on held-out records and saves the result in the run directory."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from finetune.cli import main
from finetune.evaluate.match import score
from finetune.recipe import validate_recipe
from finetune.rundir import EXPORT_MARKER, RunDir, read_jsonl
from finetune.train.run import run
from tests.run_support import sums_data, tiny_lora_recipe
from ui.views import history_rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir) -> Path:
    folder = tmp_path_factory.mktemp("gguf-run")
    recipe = tiny_lora_recipe(tiny_model_dir, sums_data(folder / "sums.jsonl", 16), folder / "run",
                              {"training": {"max_steps": 30, "micro_batch_size": 4, "learning_rate": 1e-2}})
    run(validate_recipe(recipe))
    return folder / "run"


def test_gguf_export_equals_the_merged_safetensors_export(trained, tmp_path, capsys):
    assert main(["export", str(trained), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export", str(trained), "--out", str(tmp_path / "gguf"), "--format", "gguf", "--type", "f32",
                 "--ollama"]) == 0
    out, err = capsys.readouterr()
    assert "[3/4] saving the merged model: GGUF f32" in out
    # piped, the conversion's progress: a line each tenth of the model's weights, the last at the end
    done = [(int(a), int(b)) for a, b in re.findall(r"^\d\d:\d\d:\d\d GGUF f32 tensors (\d+)/(\d+) ", err, re.M)]
    assert done[-1][0] == done[-1][1] > 10 and any(n < done[-1][1] for n, _ in done), err
    assert f"ollama create run -f {tmp_path / 'gguf' / 'Modelfile'}" in out
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == sorted([EXPORT_MARKER, "Modelfile", "run.f32.gguf"])
    assert (tmp_path / "gguf" / "Modelfile").read_text().startswith("FROM ./run.f32.gguf\n")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="run.f32.gguf").eval()
    ids = torch.randint(4, 400, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_gguf_options_without_gguf_format_are_a_usage_error(trained, tmp_path, capsys):
    assert main(["export", str(trained), "--out", str(tmp_path / "x"), "--type", "q8_0"]) == 2
    assert "apply to --format gguf" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_export_progress_as_json_lines_for_programs(trained, tmp_path, capsys):
    """--progress json: stdout is one JSON object per line, each step as it starts, then where it went."""
    from finetune.api import ExportStep
    from finetune.model.trained import EXPORT_STEPS

    assert main(["export", str(trained), "--out", str(tmp_path / "m"), "--progress", "json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    objects = [json.loads(line) for line in lines]  # nothing else on stdout
    assert [(o["step"], o["of"], o["label"]) for o in objects[:-1]] == [(i + 1, 4, s) for i, s in enumerate(EXPORT_STEPS)]
    assert objects[-1] == {"done": str(tmp_path / "m")}
    steps = [ExportStep.read(line) for line in lines]
    assert str(steps[1]) == f"[2/4] merging the adapter into it: {objects[1]['detail']}"  # the text mode's line
    assert steps[-1] == {"done": str(tmp_path / "m")} and ExportStep.read("Loading weights: 100%") is None
    assert main(["export", str(trained), "--out", str(tmp_path / "x"), "--type", "q8_0", "--progress", "json"]) == 2
    error = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert error["exit_code"] == 2 and "--type and --ollama apply to --format gguf" in error["error"]


def test_an_interrupted_gguf_export_leaves_nothing(trained, tmp_path, monkeypatch):
    import finetune.export.files as files

    def interrupted(model, tokenizer, path, **kwargs):
        path.write_bytes(b"GGUF half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(files, "write_gguf", interrupted)
    assert main(["export", str(trained), "--out", str(tmp_path / "out"), "--format", "gguf"]) == 130
    assert list(tmp_path.iterdir()) == []


def test_eval_compares_base_and_run_on_held_out_records(trained, tmp_path, capsys):
    held_out = sums_data(tmp_path / "held_out.jsonl", 20)  # records 16-19 were never trained on
    lines = held_out.read_text().splitlines()[16:]
    held_out.write_text("\n".join(lines) + "\n")
    assert main(["eval", str(trained), "--data", str(held_out), "--compare", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "base model" in out and "perplexity" in out and "held-out records" in out
    report = RunDir(trained).read_evaluation()
    base, tuned = report["models"]
    assert (base["label"], tuned["label"]) == ("base model", "run")
    assert tuned["loss"] < base["loss"] * 0.7 and tuned["perplexity"] < base["perplexity"]
    assert base["loss_tokens"] == tuned["loss_tokens"] > 0
    assert report["records_read"] == report["examples_kept"] == report["with_expected_answer"] == 4
    assert all(m["exact"]["of"] == 4 and m["numeric"]["of"] == 4 for m in report["models"])
    first = report["answers"][0]
    assert first["prompt"] == "What is 16 plus 16?" and set(first["answers"]) == {"base model", "run"}
    assert json.loads(RunDir(trained).evaluation.read_text()) == report
    assert history_rows([str(trained)])[0][4] == f"{tuned['loss']:.4f} (finetune eval)"  # the UI's Runs tab


@pytest.fixture(scope="module")
def split_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A run on 16 records of which data.validation_split holds 4 out, evaluated at its end one record per
    micro-batch: the records' answers differ in length, so only a mean per loss token over the micro-batches
    is the loss `finetune eval` measures."""
    folder = tmp_path_factory.mktemp("split-run")
    recipe = tiny_lora_recipe(tiny_model_dir, sums_data(folder / "sums.jsonl", 16), folder / "run",
                              {"data": {"validation_split": 0.25},
                               "training": {"max_steps": 4, "micro_batch_size": 1, "learning_rate": 1e-2}})
    run(validate_recipe(recipe))
    return folder / "run"


def test_eval_without_data_measures_the_runs_own_held_out_split(split_run, capsys):
    """The loss equals the run's own final evaluation (the same examples, the same adapter), and the answers are
    those of exactly the records the split held out."""
    final = [row for row in read_jsonl(split_run / "metrics.jsonl") if "eval_loss" in row][-1]
    assert main(["eval", str(split_run), "--max-new-tokens", "4"]) == 0
    report = RunDir(split_run).read_evaluation()
    (tuned,) = report["models"]
    assert tuned["loss"] == pytest.approx(final["eval_loss"], rel=1e-4)
    assert json.loads((split_run / "data_stats.json").read_text())["eval_examples"] == 4
    data = split_run.parent / "sums.jsonl"
    assert report["data"] == f"held-out split of {data} (4 records)"
    assert report["records_read"] == report["examples_kept"] == report["with_expected_answer"] == 4
    records = {f"{data}:{n}": json.loads(line)["messages"] for n, line in enumerate(data.read_text().splitlines(), 1)}
    wheres = [row["where"] for row in report["answers"]]
    assert len(set(wheres)) == 4 and set(wheres) <= set(records)
    for row in report["answers"]:
        user, answer = records[row["where"]]
        assert (row["prompt"], row["expected"]) == (user["content"], answer["content"])
    # the loss is of those records: measured again on them as a file, it is the same
    held_out = split_run.parent / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"messages": records[w]}) + "\n" for w in wheres))
    assert main(["eval", str(split_run), "--data", str(held_out), "--max-new-tokens", "4"]) == 0
    assert RunDir(split_run).read_evaluation()["models"][0]["loss"] == pytest.approx(tuned["loss"], rel=1e-5)


def test_eval_reads_renders_and_tokenizes_its_data_once(split_run, monkeypatch):
    """The check before a model loads, the split's fingerprint and the build share one read of the data: the
    file read once, each of its 16 records rendered by the chat template once, and the 4 the split held out
    tokenized (not the 12 trained on); the loss is still the run's own final evaluation's. With --data: one
    read too, its records' expected answers taken from it."""
    import finetune.data.build as build
    import finetune.data.chat as chat

    counts = {"reads": 0, "renders": 0, "texts": 0}
    read_files, render, tokenize = build.read_files, chat.ChatEncoder.render, chat.tokenize_prefixes

    def counted(name, function, add=lambda *a, **k: 1):
        def spy(*args, **kwargs):
            counts[name] += add(*args, **kwargs)
            return function(*args, **kwargs)
        return spy

    monkeypatch.setattr(build, "read_files", counted("reads", read_files))
    monkeypatch.setattr(chat.ChatEncoder, "render", counted("renders", render))
    monkeypatch.setattr(chat, "tokenize_prefixes", counted("texts", tokenize, lambda tokenizer, texts, *a, **k: len(texts)))
    assert main(["eval", str(split_run), "--max-new-tokens", "4"]) == 0
    assert counts == {"reads": 1, "renders": 16, "texts": 4}
    final = [row for row in read_jsonl(split_run / "metrics.jsonl") if "eval_loss" in row][-1]
    assert RunDir(split_run).read_evaluation()["models"][0]["loss"] == pytest.approx(final["eval_loss"], rel=1e-4)
    counts.update(reads=0, renders=0, texts=0)
    held_out = sums_data(split_run.parent / "three.jsonl", 3)
    assert main(["eval", str(split_run), "--data", str(held_out), "--max-new-tokens", "4"]) == 0
    assert counts == {"reads": 1, "renders": 3, "texts": 3}
    report = RunDir(split_run).read_evaluation()
    assert report["with_expected_answer"] == 3 and report["answers"][0]["expected"] == "It is 0."


def test_eval_of_a_split_run_whose_training_data_changed_is_refused(split_run, monkeypatch, capsys):
    """The split made again of other records would be other records: refused before a model loads, naming the
    file."""
    import finetune.evaluate.run as evaluate_run

    monkeypatch.setattr(evaluate_run, "load_adapters", lambda *a, **k: pytest.fail("a model was loaded"))
    data = split_run.parent / "sums.jsonl"
    original = data.read_text()
    before = RunDir(split_run).evaluation.read_bytes() if RunDir(split_run).evaluation.exists() else None
    try:
        data.write_text(original.replace("What is 3 plus 3?", "What is 3 plus 4?"))
        assert main(["eval", str(split_run)]) == 2
    finally:
        data.write_text(original)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"the training data ({data}) changed since the run trained on it (record content changed)" in err
    assert "--data FILE" in err
    after = RunDir(split_run).evaluation.read_bytes() if RunDir(split_run).evaluation.exists() else None
    assert after == before  # evaluation.json untouched


@pytest.mark.parametrize(("overrides", "why"), [
    ({}, "holds no records out of its training data (data.validation_split is 0)"),
    ({"data": {"validation_split": 0.25}, "training": {"method": "kto"}},
     "is a kto run: its held-out records are answers labelled good or bad, not pairs, which eval does not measure"),
])
def test_eval_without_data_of_a_run_with_no_split_to_measure_is_a_one_line_usage_error(
        tmp_path, tiny_model_dir, monkeypatch, capsys, overrides, why):
    import finetune.evaluate.run as evaluate_run

    run = _fake_run(tmp_path, tiny_model_dir, overrides)
    monkeypatch.setattr(evaluate_run, "load_adapters", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["eval", str(run.root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: finetune eval {run.root}: the run {why}; give held-out records with --data FILE"
    assert not run.evaluation.exists()


def test_eval_of_a_split_left_without_an_example_is_refused(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The one held-out record is longer than data.max_seq_len (data.overlong: drop): no loss to measure, as the
    run had no evaluation either; refused rather than a loss of 0."""
    from transformers import AutoTokenizer

    import finetune.evaluate.run as evaluate_run
    from finetune.data.build import build_datasets, built_fingerprint
    from finetune.model.trained import load_run

    run = _fake_run(tmp_path, tiny_model_dir, {"data": {"validation_split": 0.25, "overlong": "drop"}})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(run.adapter)
    recipe = load_run(run.root)[0]
    ((record, _),) = build_datasets(recipe.data, tokenizer, recipe.training.seed).held_out
    data = Path(recipe.data.path)
    lines = data.read_text().splitlines()
    lines[int(record.where.rsplit(":", 1)[1]) - 1] = json.dumps({"messages": [
        {"role": "user", "content": "What is 1 plus 1? " * 40}, {"role": "assistant", "content": "2"}]})
    data.write_text("\n".join(lines) + "\n")
    run.data_fingerprint.write_text(json.dumps(built_fingerprint(recipe.data, tokenizer, recipe.training.seed)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    monkeypatch.setattr(evaluate_run, "_models", lambda runs, with_base: iter([("run", model, tokenizer)]))
    assert main(["eval", str(run.root)]) == 3
    err = " ".join(capsys.readouterr().err.split())
    assert (f"finetune eval {run.root}: none of the 1 records data.validation_split held out of {data} is an "
            "example (each longer than data.max_seq_len=64 or without answer tokens)") in err
    assert not run.evaluation.exists()


@pytest.mark.parametrize(("answer", "expected", "want"), [
    ("Paris.", " paris. ", {"exact": True, "contains": True, "numeric": None}),
    ("The capital is Paris, of course.", "Paris", {"exact": False, "contains": True, "numeric": None}),
    ("It is 1,024 bytes.", "1024", {"exact": False, "contains": False, "numeric": True}),
    ("It is 32.", "It is 34.", {"exact": False, "contains": False, "numeric": False}),
    ("No idea.", "It is 34.", {"exact": False, "contains": False, "numeric": False}),
])
def test_answer_matching(answer, expected, want):
    assert score(answer, expected) == want


def test_a_full_fine_tune_exports_to_gguf_and_evaluates_against_its_base(tmp_path, tiny_model_dir):
    data = sums_data(tmp_path / "sums.jsonl", 8)
    run(validate_recipe(tiny_lora_recipe(tiny_model_dir, data, tmp_path / "full", {
        "adapter": {"type": "full"}, "training": {"max_steps": 12, "micro_batch_size": 4, "learning_rate": 2e-3}})))
    assert main(["export", str(tmp_path / "full"), "--out", str(tmp_path / "gguf"), "--format", "gguf",
                 "--type", "f32"]) == 0
    trained = AutoModelForCausalLM.from_pretrained(RunDir(tmp_path / "full").adapter).eval()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="full.f32.gguf").eval()
    ids = torch.randint(4, 400, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert main(["eval", str(tmp_path / "full"), "--data", str(data), "--compare", "--max-new-tokens", "4"]) == 0
    base, tuned = RunDir(tmp_path / "full").read_evaluation()["models"]
    assert base["label"] == "base model" and tuned["loss"] < base["loss"]


def test_a_k_quant_type_is_refused_before_loading_with_the_llama_quantize_way(tmp_path, capsys):
    assert main(["export", str(tmp_path / "no-run"), "--out", str(tmp_path / "x"), "--format", "gguf",
                 "--type", "q4_k_m"]) == 2
    err = capsys.readouterr().err
    assert "--type q4_k_m: not a type this exporter writes" in err and "llama-quantize" in err


def test_eval_checks_its_data_before_any_model_loads(tmp_path, tiny_model_dir, monkeypatch, capsys):
    import finetune.evaluate.run as evaluate_run

    run = _fake_run(tmp_path, tiny_model_dir)
    monkeypatch.setattr(evaluate_run, "load_adapters", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["eval", str(run.root), "--data", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"eval --data {tmp_path / 'missing.jsonl'}: no such file" in err and "data.path" not in err
    (tmp_path / "broken.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"nope": 1}\n')
    assert main(["eval", str(run.root), "--data", str(tmp_path / "broken.jsonl")]) == 3  # DataError
    assert "broken.jsonl" in capsys.readouterr().err
    assert not run.evaluation.exists()


def _fake_run(tmp_path: Path, model_dir: Path, *overrides: dict) -> RunDir:
    """A finished-looking run directory (recipe and an adapter config) for the checks before a model loads."""
    import yaml

    run = RunDir(tmp_path / "run")
    run.adapter.mkdir(parents=True)
    (run.adapter / "adapter_config.json").write_text("{}")
    run.recipe.write_text(yaml.safe_dump(tiny_lora_recipe(model_dir, sums_data(tmp_path / "d.jsonl", 4), run.root,
                                                          *overrides)))
    return run


def test_eval_counts_records_read_and_examples_kept_apart(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """A record skipped (data.on_bad_record: skip) is read but not measured: both counts, named for what they are."""
    from transformers import AutoTokenizer

    import finetune.evaluate.run as evaluate_run
    from finetune import api

    run = _fake_run(tmp_path, tiny_model_dir, {"data": {"on_bad_record": "skip"}})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    monkeypatch.setattr(evaluate_run, "_models", lambda runs, with_base: iter([("run", model, tokenizer)]))
    data = sums_data(tmp_path / "held_out.jsonl", 3)
    data.write_text(data.read_text() + '{"nope": 1}\n')
    assert main(["eval", str(run.root), "--data", str(data), "--max-new-tokens", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table title may wrap
    assert "4 held-out records read, 3 examples kept (3 with an expected answer)" in out
    report = run.read_evaluation()
    assert (report["records_read"], report["examples_kept"], report["with_expected_answer"]) == (4, 3, 3)
    table = api.run_evaluation_table(run.root)
    assert (table["records_read"], table["examples_kept"]) == (4, 3)


def test_eval_of_a_run_in_use_is_refused_naming_the_holder(tmp_path, tiny_model_dir, capsys):
    """eval writes evaluation.json into the run directory: not while a run or --resume writes there."""
    run = _fake_run(tmp_path, tiny_model_dir)
    with run.lock("finetune run --resume"):
        assert main(["eval", str(run.root), "--data", str(tmp_path / "d.jsonl")]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"finetune eval: {run.root} is in use by pid {os.getpid()} (finetune run --resume)" in err
    assert not run.evaluation.exists()


def test_a_damaged_evaluation_json_shows_what_it_still_holds(tmp_path):
    from finetune import api

    run = RunDir(tmp_path)
    good = {"label": "run", "loss": 0.5, "perplexity": 1.65, "exact": {"matched": 2, "of": 4}, "contains": "x"}
    run.evaluation.write_text(json.dumps({"records": 4, "models": [good, {"label": "base model", "loss": None}, 7]}))
    table = api.run_evaluation_table(run.root)
    assert table["rows"] == [["run", "0.5000", "1.65", "2/4", "-", "-"]]
    run.evaluation.write_text(json.dumps({"models": {"run": good}}))
    assert api.run_evaluation_table(run.root)["rows"] == []
