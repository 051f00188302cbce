"""`finetune eval`'s answers: each ends at the model's end of turn or at a length limit derived from the expected
answers (twice the longest + 16 tokens) that says which answers it cut; piped, the answers' progress is a line
per tenth of the records, not one per record."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.cli import main
from finetune.evaluate.run import ANSWER_MARGIN, answer_cap
from finetune.model.chat import reply, stop_ids
from finetune.rundir import RunDir
from tests.run_support import sums_data, tiny_lora_recipe


def _saying(model_dir, token_id: int):
    """The tiny model, made to put all its probability on `token_id` at every position (a biased head)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    torch.nn.init.zeros_(head.weight)
    with torch.no_grad():
        head.bias.zero_()
        head.bias[token_id] = 50.0
    model.lm_head = head
    return model


def test_the_chat_templates_end_of_turn_stops_an_answer_also_when_it_is_not_the_eos(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.eos_token = "<|endoftext|>"  # as a base model's tokenizer: its template still ends turns with im_end
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = _saying(tiny_model_dir, end_of_turn)
    model.generation_config.eos_token_id = None
    assert end_of_turn in stop_ids(model, tokenizer) and tokenizer.eos_token_id in stop_ids(model, tokenizer)
    answer = reply(model, tokenizer, [{"role": "user", "content": "hi"}], max_new_tokens=40)
    assert answer.text == "" and not answer.capped
    rambling = _saying(tiny_model_dir, tokenizer.convert_tokens_to_ids("a"))
    answer = reply(rambling, tokenizer, [{"role": "user", "content": "hi"}], max_new_tokens=7)
    assert answer.text == "a" * 7 and answer.capped


@pytest.fixture
def two_models(tiny_model_dir, monkeypatch):
    """`finetune eval --compare` over two models without loading a run: one that ends its turn at once, one
    that never does."""
    import finetune.evaluate.run as evaluate_run

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    models = [("brief", _saying(tiny_model_dir, tokenizer.convert_tokens_to_ids("<|im_end|>")), tokenizer),
              ("rambler", _saying(tiny_model_dir, tokenizer.convert_tokens_to_ids("a")), tokenizer)]
    monkeypatch.setattr(evaluate_run, "_models", lambda runs, with_base: iter(copy.copy(models)))
    return tokenizer


def test_eval_caps_answers_from_the_expected_ones_says_which_were_cut_and_logs_progress_by_tenths(
        tmp_path, tiny_model_dir, two_models, capsys):
    run = RunDir(tmp_path / "run")
    run.adapter.mkdir(parents=True)
    (run.adapter / "adapter_config.json").write_text("{}")  # a finished-looking run: the models are the fixture's

    run.recipe.write_text(yaml.safe_dump(tiny_lora_recipe(tiny_model_dir, sums_data(tmp_path / "d.jsonl", 4),
                                                           run.root)))
    data = sums_data(tmp_path / "held_out.jsonl", 30)
    assert main(["eval", str(run.root), "--data", str(data), "--compare"]) == 0
    out, err = capsys.readouterr()
    report = run.read_evaluation()
    expected = [a["expected"] for a in report["answers"]]
    cap = 2 * max(len(two_models(e, add_special_tokens=False)["input_ids"]) for e in expected) + ANSWER_MARGIN
    assert report["max_new_tokens"] == cap == answer_cap(two_models, expected) < 64  # the old fixed default
    assert report["max_new_tokens_from"] == "expected answers"
    assert {m["label"]: m["capped"] for m in report["models"]} == {"brief": 0, "rambler": 30}
    assert all(a["answers"]["rambler"] == "a" * cap and a["answers"]["brief"] == "" for a in report["answers"])
    flat = " ".join(out.split())
    assert (f"answers cut at {cap} new tokens (twice the longest expected answer + 16; --max-new-tokens N to "
            "change): rambler 30/30") in flat
    assert f"eval rambler: answering 30 records, at most {cap} new tokens each" in out
    for label in ("brief", "rambler"):  # piped: a line per tenth (or 30 s), the last one at the end
        lines = [line for line in err.splitlines() if f"eval {label}: answers " in line]
        assert 3 <= len(lines) <= 11 and "30/30 (100%)" in lines[-1], err
    assert "answering" not in err and "record 1" not in out  # no line per record
    # A limit given is used as given, and named so.
    assert main(["eval", str(run.root), "--data", str(data), "--compare", "--max-new-tokens", "5"]) == 0
    assert "answers cut at 5 new tokens (--max-new-tokens): rambler 30/30" in " ".join(capsys.readouterr().out.split())
    assert run.read_evaluation()["max_new_tokens_from"] == "given"
