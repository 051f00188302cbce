"""Chat with a run (finetune.model.chat): the whole history and the system prompt reach the model, replies
stream piece by piece, sampling settings reach generate(), models load once, mistakes are clear messages."""

from __future__ import annotations

import io
import json
import threading

import pytest
import torch

from finetune.errors import FinetuneError
from finetune.model.chat import ChatModels, build_prompt, serve, stream_reply
from finetune.model.trained import load_trained
from tests.chat_support import fake_run

HISTORY = [{"role": "user", "content": "My name is Ada."},
           {"role": "assistant", "content": "Hello Ada."},
           {"role": "user", "content": "I like foxes."},
           {"role": "assistant", "content": "Foxes are quick."},
           {"role": "user", "content": "What is my name?"}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    return fake_run(tmp_path_factory.mktemp("chat") / "run", tiny_model_dir)


class CountingLoader:
    def __init__(self):
        self.calls = []

    def __call__(self, run, use_adapter=True, arriving=None):
        self.calls.append((run, use_adapter))
        return load_trained(run, use_adapter=use_adapter, arriving=arriving)


def test_three_turn_history_and_system_prompt_reach_the_model_and_the_reply_streams(run_dir):
    model, tokenizer = load_trained(run_dir)
    seen = {}
    generate = model.generate

    def spy(**kwargs):
        seen.update(kwargs)
        return generate(**kwargs)

    model.generate = spy
    pieces = []
    reply = stream_reply(model, tokenizer, HISTORY, system="Answer in French.", max_new_tokens=24,
                         on_text=pieces.append)
    prompt = tokenizer.decode(seen["input_ids"][0])
    assert prompt == build_prompt(tokenizer, HISTORY, "Answer in French.")
    for turn in ("Answer in French.", "My name is Ada.", "Hello Ada.", "I like foxes.", "What is my name?"):
        assert turn in prompt
    assert prompt.endswith("<|im_start|>assistant\n"), "the model continues as the assistant"
    assert len(pieces) > 1, "the reply arrives in pieces as it is generated"
    assert "".join(pieces).strip() == reply
    assert seen["do_sample"] is False and "temperature" not in seen, "temperature 0 is greedy"

    seen.clear()
    stream_reply(model, tokenizer, HISTORY, temperature=0.7, top_p=0.85, max_new_tokens=5)
    assert (seen["do_sample"], seen["temperature"], seen["top_p"], seen["max_new_tokens"]) == (True, 0.7, 0.85, 5)


def test_a_cancelled_reply_stops_early(run_dir):
    model, tokenizer = load_trained(run_dir)
    cancel = threading.Event()
    pieces = []

    def on_text(piece):
        pieces.append(piece)
        cancel.set()

    stream_reply(model, tokenizer, HISTORY, max_new_tokens=64, on_text=on_text, cancel=cancel)
    assert len(pieces) <= 2


@pytest.mark.parametrize("temperature, top_p, where", [(-1, 1.0, "temperature"), (0.7, 0.0, "top_p")])
def test_out_of_range_sampling_is_a_clear_error(run_dir, temperature, top_p, where):
    model, tokenizer = load_trained(run_dir)
    with pytest.raises(FinetuneError, match=where):
        stream_reply(model, tokenizer, HISTORY, temperature=temperature, top_p=top_p)


def test_models_load_once_and_base_shares_the_fine_tuned_weights(run_dir):
    loader = CountingLoader()
    models = ChatModels(loader)
    answers = {}
    for adapter in (True, False, True, False):
        with models.use(run_dir, adapter) as (model, tokenizer):
            answers.setdefault(adapter, stream_reply(model, tokenizer, HISTORY[:1], max_new_tokens=12))
    assert models.loads == 1 and loader.calls == [(str(run_dir.resolve()), True)]
    assert answers[True] != answers[False], "the base answer has the adapter switched off"
    base_model, base_tokenizer = load_trained(run_dir, use_adapter=False)
    assert answers[False] == stream_reply(base_model, base_tokenizer, HISTORY[:1], max_new_tokens=12)


def test_two_runs_on_one_base_share_it_and_answer_as_if_alone(run_dir, tiny_model_dir, tmp_path):
    other = fake_run(tmp_path / "other", tiny_model_dir, seed=1)
    models = ChatModels(CountingLoader())
    answers = {}
    for run, adapter in ((run_dir, True), (other, True), (run_dir, False), (run_dir, True), (other, True)):
        with models.use(run, adapter) as (model, tokenizer):
            answer = stream_reply(model, tokenizer, HISTORY[:1], max_new_tokens=12)
        assert answers.setdefault((run, adapter), answer) == answer
    assert (models.loads, models.adapter_loads) == (1, 1)
    for run, adapter in answers:
        model, tokenizer = load_trained(run, use_adapter=adapter)
        assert answers[run, adapter] == stream_reply(model, tokenizer, HISTORY[:1], max_new_tokens=12), run
    assert len(set(answers.values())) == 3


def test_worker_protocol_counts_loads_and_reports_bad_requests(run_dir, tmp_path):
    requests = [{"op": "chat", "id": i, "run": str(run_dir), "messages": HISTORY[:1], "max_new_tokens": 6}
                for i in (1, 2, 3)]
    requests += [{"op": "chat", "id": 4, "run": str(tmp_path / "nowhere"), "messages": HISTORY[:1]},
                 {"op": "chat", "id": 5, "run": str(run_dir), "messages": []}, {"op": "stats", "id": 6}]
    out = io.StringIO()
    serve(io.StringIO("".join(json.dumps(r) + "\n" for r in requests)), out)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    done = [e for e in events if e["event"] == "done"]
    assert [e["id"] for e in done] == [1, 2, 3] and [e["loads"] for e in done] == [1, 1, 1]
    assert [e["id"] for e in events if e["event"] == "loading"] == [1]
    assert all(e["text"] == "".join(t["text"] for t in events if t["event"] == "text" and t["id"] == e["id"])
               .strip() for e in done)
    errors = {e["id"]: e["message"] for e in events if e["event"] == "error"}
    assert "is not a run directory" in errors[4]
    assert "must end with a user message" in errors[5]
    assert events[-1] == {"id": 6, "event": "stats", "loads": 1, "adapter_loads": 0}


class Replies(io.StringIO):
    """The worker's replies, with what was still loaded (`alive()`) when each event was written."""

    def __init__(self, alive):
        super().__init__()
        self.alive, self.seen = alive, []

    def write(self, text: str) -> int:
        self.seen.append((json.loads(text), self.alive()))
        return super().write(text)


def test_the_worker_lets_go_of_the_models_no_shown_run_uses(run_dir, tiny_model_dir, tmp_path):
    """Clicking through runs keeps what is shown (a request's "keep": the UI's columns; absent, its own run):
    a run on another base drops the last one's model (its memory freed), a run sharing a base drops only the
    adapter of the run no longer shown."""
    import gc
    import shutil
    import weakref

    shutil.copytree(tiny_model_dir, tmp_path / "other-base")
    other_base = fake_run(tmp_path / "b", tmp_path / "other-base", seed=2)
    same_base = fake_run(tmp_path / "c", tiny_model_dir, seed=1)
    loaded = []  # (run, weakref to its model) per load

    def loader(run, use_adapter=True, arriving=None):
        model, tokenizer = load_trained(run, use_adapter=use_adapter, arriving=arriving)
        loaded.append((run, weakref.ref(model)))
        return model, tokenizer

    def chat(rid, run, *keep):
        request = {"op": "chat", "id": rid, "run": str(run), "messages": HISTORY[:1], "max_new_tokens": 4}
        return json.dumps({**request, "keep": [{"run": str(r), "adapter": True} for r in keep]} if keep else request)

    a, b, c = (str(r.resolve()) for r in (run_dir, other_base, same_base))
    requests = [chat(1, run_dir), chat(2, same_base, run_dir, same_base), chat(3, other_base),
                chat(4, run_dir, run_dir, other_base), chat(5, other_base, run_dir, other_base),
                chat(6, same_base, same_base)]
    models = ChatModels(loader)
    out = Replies(lambda: [(run, sorted(model().peft_config)) for run, model in loaded if model() is not None])
    serve(io.StringIO("".join(r + "\n" for r in requests)), out, models)
    done = {event["id"]: alive for event, alive in out.seen if event["event"] == "done"}
    assert [run for run, _ in loaded] == [a, b, a], "A again after B: the only reloads"
    assert done[1] == [(a, ["default"])]
    assert done[2] == [(a, ["default", "run1"])], "two runs on one base shown side by side: one model"
    assert done[3] == [(b, ["default"])], "another base shown alone: the first base let go"
    assert done[4] == done[5] == [(b, ["default"]), (a, ["default"])], "both shown: both kept"
    assert done[6] == [(a, ["run2"])], "B let go; C's adapter joins A's base, A's adapter leaves it"
    assert all(event["event"] != "error" for event, _ in out.seen), out.getvalue()
    gc.collect()
    assert [model() for _, model in loaded] == [None, None, None], "the worker's end lets go of every model"


def test_a_run_without_adapter_is_a_clear_error(run_dir, tmp_path):
    import shutil

    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(run_dir / "recipe.yaml", half / "recipe.yaml")
    with pytest.raises(FinetuneError, match="has no trained adapter yet"):
        with ChatModels().use(half):
            pass


def test_without_a_chat_template_a_lone_prompt_is_continued_and_a_conversation_is_a_transcript(tiny_tokenizer):
    import copy

    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = None
    assert build_prompt(plain, HISTORY[:1]) == "My name is Ada."
    assert build_prompt(plain, HISTORY[:3], "Be brief.") == (
        "system: Be brief.\nuser: My name is Ada.\nassistant: Hello Ada.\nuser: I like foxes.\nassistant: ")


# A change to a second run's recipe -> whether it still trains the same base model (finetune.model.trained.
# base_model_key, the one rule of chat and compare_runs). The old rules: chat compared the whole model and
# quantization sections as written, compare_runs (load_adapters) model.path and the quantization section.
SAME_BASE = {
    # both said "different": the same folder spelled another way, 4-bit options without 4 bits
    "folder through a symlink": ({"model": {"path": "LINK"}}, True),
    "4-bit options without 4 bits": ({"quantization": {"quant_type": "fp4", "double_quant": False}}, True),
    # chat said "different", compare_runs "same": the attention kernel (the weights are the same) ...
    "attention kernel": ({"model": {"attn_implementation": "eager"}}, True),
    # ... and other weights or code (compare_runs put the second adapter on the first run's base)
    "revision": ({"model": {"revision": "v2"}}, False),
    "dtype": ({"model": {"dtype": "OTHER"}}, False),
    "remote code": ({"model": {"trust_remote_code": True}}, False),
}


@pytest.mark.parametrize("change, same", SAME_BASE.values(), ids=SAME_BASE)
def test_chat_and_compare_agree_on_which_runs_share_a_base_model(run_dir, tiny_model_dir, tmp_path, change,
                                                                 same):
    import shutil

    import yaml

    from finetune.model.load import compute_dtype
    from finetune.model.trained import base_model_key, load_adapters, load_run
    from finetune.recipe.schema import ModelConfig

    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    (tmp_path / "link").symlink_to(tiny_model_dir, target_is_directory=True)
    recipe = yaml.safe_load((other / "recipe.yaml").read_text())
    for section, values in change.items():
        recipe[section].update(values)
    if recipe["model"]["path"] == "LINK":
        recipe["model"]["path"] = str(tmp_path / "link")
    if recipe["model"]["dtype"] == "OTHER":  # a dtype other than the one auto loads in on this machine
        auto = compute_dtype(ModelConfig(path="x"))
        recipe["model"]["dtype"] = "fp32" if auto != torch.float32 else "bf16"
    (other / "recipe.yaml").write_text(yaml.safe_dump(recipe))

    assert (base_model_key(load_run(run_dir)[0]) == base_model_key(load_run(other)[0])) is same
    models = ChatModels(CountingLoader())
    for run in (run_dir, other):
        with models.use(run):
            pass
    assert (models.loads, models.adapter_loads) == ((1, 1) if same else (2, 0))
    if same:
        assert len(load_adapters([run_dir, other])[2]) == 2
    else:
        with pytest.raises(FinetuneError, match="(?s)trained on .*compare runs trained on the same base"):
            load_adapters([run_dir, other])
