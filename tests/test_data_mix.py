"""data.path as a list of files: each read in its own format, mixed by weight or record count and shuffled by the
seed; the stats and the fingerprint cover every file; bad lists, missing and broken files are named by key or
file and line; the web UI's allowed-folders check covers every file of the list."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.data import build_datasets, preview
from finetune.data.fingerprint import data_changes
from finetune.data.mix import mixed_records, read_files
from finetune.errors import DataError, RecipeError
from finetune.recipe import validate_recipe
from finetune.recipe.load import load_recipe_text
from finetune.recipe.schema import DataConfig
from tests.run_support import sums_data, tiny_lora_recipe


def alpaca(path: Path, n: int, word: str = "colour") -> Path:
    """`n` alpaca records in a JSON array, each answer naming its file's `word`."""
    path.write_text(json.dumps([{"instruction": f"Name a {word} ({i}).", "input": "", "output": f"{word} {i}"}
                                for i in range(n)]))
    return path


def data(path, **keys) -> DataConfig:
    return DataConfig(path=path, **{"max_seq_len": 64, **keys})


def origin(records) -> Counter:
    return Counter(r.file for r in records)


def test_two_formats_mix_into_one_dataset_with_counts_per_file(tmp_path, tiny_tokenizer):
    first, second = alpaca(tmp_path / "a.json", 5), sums_data(tmp_path / "m.jsonl", 7)
    bundle = build_datasets(data([str(first), str(second)]), tiny_tokenizer, seed=0)
    assert bundle.stats["format"] == "alpaca+messages"
    assert bundle.stats["records"] == 12 and bundle.stats["train_examples"] == 12
    assert bundle.stats["files"] == [
        {"path": str(first), "format": "alpaca", "records": 5, "used": 5, "kept": 5, "dropped": 0},
        {"path": str(second), "format": "messages", "records": 7, "used": 7, "kept": 7, "dropped": 0}]
    texts = [tiny_tokenizer.decode(ids) for ids in bundle.train["input_ids"]]
    assert sum("Name a colour" in t for t in texts) == 5 and sum("plus" in t for t in texts) == 7
    # The preview shows the files' records in turn, each in its own file's format.
    shown = preview(data([str(first), str(second)]), tiny_tokenizer, n=12)
    assert [ex["format"] for ex in shown] == ["alpaca", "messages"] * 5 + ["messages"] * 2
    assert [ex["where"] for ex in shown[:3]] == [f"{first} record 0", f"{second}:1", f"{first} record 1"]


def test_per_file_counts_name_what_each_file_lost(tmp_path, tiny_tokenizer):
    good = alpaca(tmp_path / "a.json", 6)
    broken = sums_data(tmp_path / "m.jsonl", 5)
    lines = broken.read_text().splitlines()
    lines[1] = "{not json"
    lines[3] = json.dumps({"messages": [{"role": "user", "content": "long " * 200},
                                        {"role": "assistant", "content": "yes"}]})
    broken.write_text("\n".join(lines) + "\n")
    bundle = build_datasets(data([str(good), str(broken)], on_bad_record="skip", overlong="drop"), tiny_tokenizer, 0)
    assert bundle.stats["files"][0] | {"path": ""} == {"path": "", "format": "alpaca", "records": 6, "used": 6,
                                                       "kept": 6, "dropped": 0}
    assert bundle.stats["files"][1] | {"path": ""} == {"path": "", "format": "messages", "records": 5, "used": 4,
                                                       "kept": 3, "dropped": 1}  # line 2 never parsed
    assert bundle.stats["bad_records_at"] == [f"{broken}:2"] and bundle.stats["overlong_at"] == [f"{broken}:4"]


def test_weights_give_each_file_its_share_and_repeat_no_record(tmp_path):
    small, large = alpaca(tmp_path / "s.json", 300, "tree"), alpaca(tmp_path / "l.json", 600, "bird")
    cfg = data([{"path": str(small), "weight": 1}, {"path": str(large), "weight": 3}])
    records = mixed_records(cfg, read_files(cfg), seed=0)
    # 300 / 0.25 = 1200 > 600 / 0.75 = 800: the large file is used whole, the small one sampled to 200.
    assert origin(records) == {0: 200, 1: 600}
    assert len({r.where for r in records}) == 800, "no record repeats"
    for start in range(0, 800, 200):  # shuffled together: every stretch holds about a quarter from the small file
        assert 0.15 < origin(records[start:start + 200])[0] / 200 < 0.35
    equal = data([{"path": str(small), "weight": 0.5}, {"path": str(large), "weight": 0.5}])
    assert origin(mixed_records(equal, read_files(equal), seed=0)) == {0: 300, 1: 300}


def test_records_takes_exactly_that_many_repeating_a_smaller_file(tmp_path, tiny_tokenizer):
    small, large = alpaca(tmp_path / "s.json", 40, "tree"), alpaca(tmp_path / "l.json", 300, "bird")
    cfg = data([{"path": str(small), "records": 100}, {"path": str(large), "records": 50}])
    records = mixed_records(cfg, read_files(cfg), seed=3)
    assert origin(records) == {0: 100, 1: 50}
    assert set(Counter(r.where for r in records if r.file == 0).values()) == {2, 3}, "every record twice, some thrice"
    assert len({r.where for r in records if r.file == 1}) == 50, "a sample, no repeats"
    bundle = build_datasets(cfg, tiny_tokenizer, seed=3)
    assert bundle.stats["train_examples"] == 150
    assert any(f"{small}: its 40 records repeated to make 100 (data.path[0].records)" in w for w in bundle.warnings)
    # A plain path beside them gives every record it has.
    plain = data([str(small), {"path": str(large), "records": 50}])
    assert origin(mixed_records(plain, read_files(plain), seed=3)) == {0: 40, 1: 50}


def test_copies_of_a_record_stay_on_one_side_of_the_validation_split(tmp_path, tiny_tokenizer):
    small = alpaca(tmp_path / "s.json", 10, "tree")
    cfg = data([{"path": str(small), "records": 30}, str(alpaca(tmp_path / "l.json", 10, "bird"))],
               validation_split=0.2)
    bundle = build_datasets(cfg, tiny_tokenizer, seed=5)
    train, held = ({tiny_tokenizer.decode(ids) for ids in part["input_ids"]} for part in (bundle.train, bundle.eval))
    assert not train & held, "a held-out example is also trained on"
    assert bundle.stats["train_examples"] + bundle.stats["eval_examples"] == 40
    assert len(held) == 4, "a fifth of the 20 distinct records"


def test_the_seed_decides_the_mix(tmp_path, tiny_tokenizer):
    files = [{"path": str(alpaca(tmp_path / "s.json", 30, "tree")), "records": 20},
             {"path": str(alpaca(tmp_path / "l.json", 30, "bird")), "weight": 1}]

    def examples(seed: int) -> list[list[int]]:
        return build_datasets(data(files), tiny_tokenizer, seed=seed).train["input_ids"]

    assert examples(1) == examples(1)
    assert examples(1) != examples(2)
    cfg = data(files)
    first, again, other = (mixed_records(cfg, read_files(cfg), seed) for seed in (1, 1, 2))
    assert [r.where for r in first] == [r.where for r in again]
    assert [r.where for r in first] != [r.where for r in other]
    assert {r.where for r in first if r.file == 0} != {r.where for r in other if r.file == 0}, "another sample too"


def test_the_fingerprint_covers_every_file_and_its_share(tmp_path, tiny_tokenizer):
    first, second = alpaca(tmp_path / "a.json", 6), sums_data(tmp_path / "m.jsonl", 6)

    def fingerprint(files) -> dict:
        return build_datasets(data(files), tiny_tokenizer, seed=0).fingerprint

    base = fingerprint([str(first), {"path": str(second), "weight": 1.0}])
    assert data_changes(base, fingerprint([str(first), {"path": str(second), "weight": 1.0}])) == []
    assert data_changes(base, fingerprint([str(first), {"path": str(second), "weight": 2.0}])) == \
        ["data.path[1].weight 1.0 -> 2.0"]
    assert data_changes(base, fingerprint([str(first), {"path": str(second), "records": 4}])) == \
        ["data.path[1].weight 1.0 -> None", "data.path[1].records None -> 4"]
    lines = second.read_text().splitlines()
    second.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    assert data_changes(base, fingerprint([str(first), {"path": str(second), "weight": 1.0}])) == \
        [f"data.path[1] ({second}): record content changed"]
    alpaca(first, 7)
    assert data_changes(base, fingerprint([str(first), {"path": str(second), "weight": 1.0}]))[0] == \
        f"data.path[0] ({first}): records 6 -> 7"
    single = build_datasets(data(str(first)), tiny_tokenizer, seed=0).fingerprint
    assert "files" not in single and single["path"] == str(first)
    assert data_changes(single, fingerprint([str(first)])) == \
        ["data.path one file -> a list of files (mixed and shuffled)"]


@pytest.mark.parametrize(("entries", "key", "words"), [
    ("[]", "data.path", "an empty list names no data"),
    ("[a.json, {path: b.json, weight: 0}]", "data.path[1].weight", "greater than 0"),
    ("[a.json, {path: b.json, weight: -0.5}]", "data.path[1].weight", "greater than 0"),
    ("[a.json, {path: b.json, weight: .nan}]", "data.path[1].weight", "must be a finite number"),
    ("[{path: a.json, weight: 1, records: 5}, b.json]", "data.path[0]", "give weight (a share of the mix) or "
                                                                         "records (a count), not both"),
    ("[a.json, b.json, ./a.json]", "data.path", "entries 0 and 2 name the same file (./a.json)"),
    ("[a.json, {path: b.json, wieght: 2}]", "data.path[1].wieght", "did you mean data.path[1].weight?"),
    ("[a.json, {path: b.json, records: 0}]", "data.path[1].records", "greater than or equal to 1"),
    ("[a.json, 3]", "data.path[1]", "expected a file path, or a mapping"),
])
def test_bad_lists_are_one_problem_naming_the_key(tmp_path, capsys, entries, key, words):
    text = f"model: {{path: m}}\ndata:\n  max_seq_len: 64\n  path: {entries}\n"
    with pytest.raises(RecipeError) as err:
        load_recipe_text(text, "mix.yaml")
    (problem,) = err.value.problems
    assert problem.key == key and words in problem and problem.startswith("mix.yaml:4: "), problem
    (tmp_path / "mix.yaml").write_text(text)
    assert main(["validate", str(tmp_path / "mix.yaml")]) == 2
    err = capsys.readouterr().err
    assert words in " ".join(err.split()) and "Traceback" not in err


def recipe_file(tmp_path: Path, model: Path, files: list) -> Path:
    recipe = tiny_lora_recipe(model, tmp_path / "unused", tmp_path / "run", {"training": {"max_steps": 2}})
    recipe["data"]["path"] = files
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_preflight_names_the_missing_or_broken_file(tmp_path, tiny_model_dir, capsys):
    good, broken = alpaca(tmp_path / "a.json", 4), sums_data(tmp_path / "m.jsonl", 5)
    recipe = recipe_file(tmp_path, tiny_model_dir, [str(good), {"path": str(tmp_path / "gone.jsonl"), "weight": 1}])
    assert main(["validate", str(recipe)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"data.path[1] '{tmp_path / 'gone.jsonl'}' does not exist" in err and "Traceback" not in err
    lines = broken.read_text().splitlines()
    lines[2] = lines[2][:-4]
    broken.write_text("\n".join(lines) + "\n")
    recipe = recipe_file(tmp_path, tiny_model_dir, [str(good), str(broken)])
    for command in ("validate", "run"):
        assert main([command, str(recipe)]) == 3, command
        err = " ".join(capsys.readouterr().err.split())
        assert f"{broken}:3: not valid JSON" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
    broken.write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    assert main(["validate", str(recipe)]) == 0
    assert f"data {good} + {broken}: 8 alpaca+messages records" in " ".join(capsys.readouterr().out.split())


def test_formats_that_make_other_examples_are_not_mixed(tmp_path, tiny_tokenizer):
    chat = alpaca(tmp_path / "a.json", 4)
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": f"plain text {i}"}) + "\n" for i in range(4)))
    with pytest.raises(DataError, match=r"data.path\[0\] \(.*a.json\) holds conversations \(alpaca\) but "
                                        r"data.path\[1\] \(.*t.jsonl\) holds plain text \(text\)"):
        build_datasets(data([str(chat), str(text)]), tiny_tokenizer, seed=0)
    with pytest.raises(DataError, match="cannot be mixed in one dataset"):  # the UI's preview too
        preview(data([str(text), str(chat)]), tiny_tokenizer, n=8)


def test_a_mixed_recipe_trains_and_resume_refuses_another_weight(tmp_path, tiny_model_dir, capsys):
    files = [{"path": str(alpaca(tmp_path / "a.json", 8)), "records": 12}, str(sums_data(tmp_path / "m.jsonl", 6))]
    recipe = recipe_file(tmp_path, tiny_model_dir, files)
    assert main(["run", str(recipe)]) == 0
    saved = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    assert saved["data"]["path"] == files, "the run's recipe keeps the list as written"
    files[0]["records"] = 16
    recipe = recipe_file(tmp_path, tiny_model_dir, files)
    capsys.readouterr()
    assert main(["run", str(recipe), "--resume"]) == 2
    assert "data.path[0].records 12 -> 16" in capsys.readouterr().err


def test_prompt_files_mix_for_grpo(tmp_path, tiny_tokenizer):
    from finetune.data.build import check_records

    paths = []
    for name, n in (("p.jsonl", 4), ("q.jsonl", 6)):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": f"{name} {i}?", "answer": str(i)}) + "\n" for i in range(n)))
        paths.append(str(path))
    cfg = data([paths[0], {"path": paths[1], "records": 3}])
    bundle = build_datasets(cfg, tiny_tokenizer, seed=0, method="grpo", max_prompt_tokens=48)
    assert [f["used"] for f in bundle.stats["files"]] == [4, 3] and bundle.stats["train_prompts"] == 7
    assert check_records(cfg, "grpo")["files"] == [{"path": paths[0], "format": "prompt", "records": 4, "bad_records": 0},
                                                   {"path": paths[1], "format": "prompt", "records": 6, "bad_records": 0}]


def test_the_web_form_reads_a_list_and_the_path_check_covers_every_file(tmp_path):
    from finetune.errors import FinetuneError
    from ui.form import dict_to_values, form_specs, values_to_dict
    from ui.paths import check_recipe_paths

    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    recipe = validate_recipe({"model": {"path": str(allowed / "m")}, "output": {"dir": str(allowed / "run")},
                              "data": {"path": [str(allowed / "a.json"), {"path": str(outside / "b.json"), "weight": 2}]}})
    specs = form_specs()
    values = dict_to_values(specs, recipe.model_dump(mode="python"))
    assert values[[s.key for s in specs].index("data.path")] == f"[{allowed / 'a.json'}, {{path: {outside / 'b.json'}, weight: 2.0}}]"
    assert validate_recipe(values_to_dict(specs, values)) == recipe
    with pytest.raises(FinetuneError, match=rf"data.path\[1\] {outside / 'b.json'} is outside the allowed folders"):
        check_recipe_paths(recipe, [allowed.resolve()])
    check_recipe_paths(recipe, [tmp_path.resolve()])


def test_identity_mixed_with_alpaca_as_docs_training_shows(shared_datasets, tiny_tokenizer):
    """The example of docs/training.md ("Mixing several files"): the identity set repeated to 300 records
    beside the alpaca demo's 999."""
    cfg = data([{"path": str(shared_datasets / "identity.json"), "records": 300},
                str(shared_datasets / "alpaca_en_demo.json")], max_seq_len=256)
    bundle = build_datasets(cfg, tiny_tokenizer, seed=42)
    assert [(f["records"], f["used"]) for f in bundle.stats["files"]] == [(91, 300), (999, 999)]
    assert bundle.stats["format"] == "alpaca" and bundle.stats["train_examples"] == 1299


def test_preference_pairs_of_two_formats_mix_for_dpo_and_kto(tmp_path, tiny_tokenizer):
    flat = tmp_path / "p.jsonl"
    flat.write_text("".join(json.dumps({"prompt": f"Pick {i}.", "chosen": f"yes {i}", "rejected": "no"}) + "\n"
                            for i in range(4)))
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"Say {i}."}],
                                     "chosen": {"from": "gpt", "value": f"{i}"},
                                     "rejected": {"from": "gpt", "value": "nothing"}} for i in range(3)]))
    cfg = data([str(flat), {"path": str(sharegpt), "records": 2}])
    pairs = build_datasets(cfg, tiny_tokenizer, seed=0, method="dpo")
    assert pairs.stats["format"] == "preference+sharegpt_preference" and len(pairs.train) == 6
    assert [f["kept"] for f in pairs.stats["files"]] == [4, 2]
    kto = build_datasets(cfg, tiny_tokenizer, seed=0, method="kto")
    assert sorted(kto.train["kto_label"]) == [False] * 6 + [True] * 6, "each pair as a good and a bad answer"
    with pytest.raises(DataError, match=r"p.jsonl: the records are preference data"):
        build_datasets(data([str(alpaca(tmp_path / "a.json", 3)), str(flat)]), tiny_tokenizer, seed=0)
