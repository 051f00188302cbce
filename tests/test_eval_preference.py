"""`finetune eval` of a preference run (training.method dpo): on the run's held-out pairs, or on a file of pairs,
the share of pairs whose chosen answer the model gives the higher log-probability, the implicit reward's
accuracy and margin against the base model, and the chosen answers' NLL per token, for the run and the base."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from finetune.cli import main
from finetune.rundir import RunDir, read_jsonl
from finetune.train.run import run
from tests.test_preference_train import _pairs, _recipe


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, tiny_model_dir):
    """A DPO run on 24 learnable pairs (the chosen answer names the colour asked for), 6 held out."""
    folder = tmp_path_factory.mktemp("dpo-eval")
    run(_recipe(folder, tiny_model_dir, training={"max_steps": 12, "micro_batch_size": 2}))
    return folder / "run"


def test_eval_of_a_dpo_run_measures_its_held_out_pairs_against_the_base_model(dpo_run, capsys):
    """Through the CLI: the run prefers the chosen answers more than the base does; its reward accuracy and
    margin are those the run's own final evaluation logged on the same pairs."""
    assert main(["eval", str(dpo_run), "--compare"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table's title wrapped at the terminal's width
    assert "preference pairs, dpo beta=0.1: reward vs the base model (adapters off)" in out
    report = RunDir(dpo_run).read_evaluation()
    base, tuned = report["models"]
    assert (base["label"], tuned["label"]) == ("base model", dpo_run.name)
    assert report["data"] == f"held-out split of {dpo_run.parent / 'pairs.jsonl'} (6 records)"
    assert base["pairs"] == tuned["pairs"] == report["examples_kept"] == 6
    assert tuned["logp_margin"] > base["logp_margin"] and tuned["prefers_chosen"] >= base["prefers_chosen"]
    assert tuned["chosen_nll"] < base["chosen_nll"]
    assert base["reward_accuracy"] is None and base["reward_margin"] is None  # the base is its own reference
    assert tuned["reward_margin"] > 0
    final = [row for row in read_jsonl(dpo_run / "metrics.jsonl") if "eval_loss" in row][-1]
    assert tuned["loss"] == pytest.approx(final["eval_loss"], rel=1e-4)
    assert tuned["reward_margin"] == pytest.approx(final["eval_rewards/margins"], rel=1e-3, abs=1e-5)
    assert tuned["reward_accuracy"] == pytest.approx(final["eval_rewards/accuracies"])
    assert f"│ {dpo_run.name} │ {tuned['loss']:.4f} │ {tuned['prefers_chosen']:.1%} │" in out  # a row per model


def test_the_numbers_are_the_log_probabilities_summed_by_hand(dpo_run, tiny_model_dir, tmp_path):
    """One pair given with --data: the log-probability of each answer's tokens summed with torch over the run's
    model (adapter on) and the base (adapter off) gives the margins, reward and NLL the report has."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair = {"prompt": "Say red.", "chosen": "red red.", "rejected": "blue blue."}
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps(pair) + "\n")
    assert main(["eval", str(dpo_run), "--data", str(data)]) == 0
    (tuned,) = RunDir(dpo_run).read_evaluation()["models"]

    tokenizer = AutoTokenizer.from_pretrained(RunDir(dpo_run).adapter)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), RunDir(dpo_run).adapter)
    model.eval()

    def logp(answer: str) -> tuple[float, int]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": pair["prompt"]}], tokenize=False,
                                               add_generation_prompt=True)
        whole = tokenizer.apply_chat_template([{"role": "user", "content": pair["prompt"]},
                                               {"role": "assistant", "content": answer}], tokenize=False)
        whole = whole.removesuffix("\n")  # the template's newline after the end of turn is not trained on
        start = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        ids = torch.tensor([tokenizer(whole, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        token = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        return float(token[start - 1:].sum()), ids.shape[1] - start

    (pc, cc), (pr, _) = logp(pair["chosen"]), logp(pair["rejected"])
    with model.disable_adapter():
        (rc, _), (rr, _) = logp(pair["chosen"]), logp(pair["rejected"])
    assert tuned["pairs"] == 1
    assert tuned["logp_margin"] == pytest.approx(pc - pr, rel=1e-4, abs=1e-4)
    assert tuned["chosen_nll"] == pytest.approx(-pc / cc, rel=1e-4)
    assert tuned["reward_margin"] == pytest.approx(0.1 * ((pc - rc) - (pr - rr)), rel=1e-3, abs=1e-5)
    assert tuned["prefers_chosen"] == float(pc > pr)


def test_eval_refuses_the_split_when_the_pairs_changed(dpo_run, monkeypatch, capsys):
    import finetune.evaluate.run as evaluate_run

    monkeypatch.setattr(evaluate_run, "load_adapters", lambda *a, **k: pytest.fail("a model was loaded"))
    data = dpo_run.parent / "pairs.jsonl"
    original = data.read_text()
    before = RunDir(dpo_run).evaluation.read_bytes() if RunDir(dpo_run).evaluation.exists() else None
    try:
        data.write_text(original.replace('"Say ', '"Please say ', 1))
        assert main(["eval", str(dpo_run)]) == 2
    finally:
        data.write_text(original)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"the training data ({data}) changed since the run trained on it" in err
    after = RunDir(dpo_run).evaluation.read_bytes() if RunDir(dpo_run).evaluation.exists() else None
    assert after == before


def test_a_file_of_pairs_is_measured_as_pairs(dpo_run, tmp_path):
    data = _pairs(tmp_path / "more.jsonl", n=5, seed=7)
    assert main(["eval", str(dpo_run), "--data", str(data)]) == 0
    report = RunDir(dpo_run).read_evaluation()
    assert report["data"] == str(data.resolve()) and report["records_read"] == 5
    assert report["preference"]["method"] == "dpo" and "answers" not in report
    (tuned,) = report["models"]
    assert tuned["pairs"] == 5 and tuned["prefers_chosen"] > 0.5



def test_a_file_of_conversations_is_measured_as_for_an_sft_run(dpo_run, tmp_path):
    """A dpo run given held-out conversations with expected answers: their loss and greedy answers, as for
    an sft run (the file's format decides, not the run's method)."""
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {c}."},
                                                     {"role": "assistant", "content": f"{c} {c}."}],
                                        "expected": c}) + "\n" for c in ("red", "blue", "green")))
    run = shutil.copytree(dpo_run, tmp_path / "run")  # its evaluation.json is the other tests'
    assert main(["eval", str(run), "--data", str(data), "--max-new-tokens", "4"]) == 0
    report = RunDir(run).read_evaluation()
    assert "preference" not in report and report["with_expected_answer"] == 3 and len(report["answers"]) == 3
    (tuned,) = report["models"]
    assert tuned["loss_tokens"] > 0 and tuned["perplexity"] > 1

def test_a_file_without_pairs_is_a_one_line_error(dpo_run, tmp_path, monkeypatch, capsys):
    import finetune.evaluate.run as evaluate_run

    monkeypatch.setattr(evaluate_run, "load_adapters", lambda *a, **k: pytest.fail("a model was loaded"))
    before = RunDir(dpo_run).evaluation.read_bytes() if RunDir(dpo_run).evaluation.exists() else None
    data = tmp_path / "labelled.jsonl"
    data.write_text(json.dumps({"prompt": "Say red.", "completion": "red red.", "label": True}) + "\n")
    assert main(["eval", str(dpo_run), "--data", str(data)]) != 0
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    line, hint = err.splitlines()
    assert line.startswith(f"error: eval --data: {data}: training.method dpo needs chosen/rejected pairs, but the "
                           "records are kto")
    assert hint == "give records with prompt/chosen/rejected to measure a dpo run's preferences"
    assert (RunDir(dpo_run).evaluation.read_bytes() if RunDir(dpo_run).evaluation.exists() else None) == before


def test_the_tables_read_a_preference_report(dpo_run):
    """The UI's run view and the CLI's table read the report: a column per measure, a row per model."""
    from finetune import api
    from ui.views import evaluation_markdown

    table = api.run_evaluation_table(dpo_run)
    assert table["headers"][:3] == ["model", "loss", "prefers chosen"]
    markdown = evaluation_markdown(table)
    assert "preference pairs of a dpo run" in markdown and f"| {dpo_run.name} |" in markdown
