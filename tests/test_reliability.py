"""Careless inputs through the real CLI, each one line with the documented exit code, no traceback and nothing
left behind: data mixes that would exhaust memory, images that fail to decode (or are too narrow, or name a
NUL byte, or are null), decompression-bomb headers for `generate --image`, exports to folders that cannot take
them, offload folders that cannot be made or lack room, and MoE-only keys on a dense model. Every input is
written by the test (a few bytes each)."""

from __future__ import annotations

import base64
import errno
import io
import json
import os
import shutil
import struct
import sys
import zlib
from pathlib import Path

import pytest
import yaml
from run_support import sums_data, three_step_recipe, tiny_lora_recipe

from finetune.cli import main
from finetune.errors import DataError, RecipeError

ASK = {"role": "user", "content": "<image>What colour is it?"}
ANSWER = {"role": "assistant", "content": "Red."}


def one_error(capsys, code: int, result: int) -> str:
    """The command's stderr, checked: exit `code`, one `error:` line (a hint may follow), no traceback."""
    err = capsys.readouterr().err
    assert result == code, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return " ".join(err.split())


def png(size: tuple[int, int] = (32, 24), colour: str = "red") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return out.getvalue()


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` pixels: its header and end, no pixels."""
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def broken_images() -> dict[str, bytes]:
    """Files whose header (and end marker) are good and whose pixels do not decode."""
    from PIL import Image

    good = png()
    start = good.index(b"IDAT")
    length = struct.unpack(">I", good[start - 4:start])[0]
    idat = good[start + 4:start + 4 + length]
    corrupt = bytes(b ^ 0xFF for b in idat)
    gif = io.BytesIO()
    Image.new("P", (16, 16)).save(gif, "GIF")
    lzw = bytearray(gif.getvalue())
    body = lzw.index(b",") + 11  # past the image descriptor and the LZW code size: the compressed pixels
    lzw[body:len(lzw) - 2] = b"\xff" * (len(lzw) - 2 - body)
    return {
        "corrupt-idat.png": good[:start - 4] + chunk(b"IDAT", corrupt) + good[start + 4 + length + 4:],
        "short-idat.png": good[:start - 4] + chunk(b"IDAT", idat[:5]) + good[start + 4 + length + 4:],
        "corrupt-lzw.gif": bytes(lzw),
        "drawing.eps": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n%%EOF\n",
    }


def recipe_file(folder: Path, model: Path, source: Path | list, **sections: dict) -> Path:
    values = tiny_lora_recipe(model, Path("unused"), folder / "run", {"training": {"max_steps": 1}}, sections)
    values["data"]["path"] = source if isinstance(source, list) else str(source)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    from finetune.testing import vision_model

    return vision_model("qwen2_5_vl", tmp_path_factory.mktemp("vlm") / "model")


def image_records(folder: Path, images: dict[str, bytes]) -> Path:
    """One good record, then one record per image of `images` (written beside the data file)."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    (folder / "img" / "good.png").write_bytes(png())
    rows = [{"messages": [ASK, ANSWER], "images": ["img/good.png"]}]
    for name, data in images.items():
        (folder / "img" / name).write_bytes(data)
        rows.append({"messages": [ASK, ANSWER], "images": [f"img/{name}"]})
    path = folder / "data.json"
    path.write_text(json.dumps(rows))
    return path


# ---- 1. data mixes that would exhaust memory --------------------------------------------------------------


def test_a_mix_asking_for_more_copies_than_the_limit_is_refused_by_validate_and_run(tmp_path, tiny_model_dir,
                                                                                    capsys):
    small = sums_data(tmp_path / "alpaca.jsonl", 10)
    other = sums_data(tmp_path / "msgs.jsonl", 4)
    path = recipe_file(tmp_path, tiny_model_dir, [{"path": str(small), "records": 2147483647}, str(other)])
    for command in ("validate", "plan", "run"):
        line = one_error(capsys, RecipeError.exit_code, main([command, str(path)]))
        assert "data.path[0].records: 2,147,483,647 is over 100 times the 10 records" in line, line
        assert not (tmp_path / "run").exists()
    path = recipe_file(tmp_path, tiny_model_dir, [{"path": str(small), "records": 1000}, str(other)])
    assert main(["validate", str(path)]) == 0  # exactly 100 copies: allowed
    capsys.readouterr()


@pytest.mark.parametrize("weight", [float("inf"), float("nan"), 0.0, -1.0])
def test_a_weight_that_is_not_finite_and_positive_is_a_recipe_error(tmp_path, tiny_model_dir, capsys, weight):
    data = sums_data(tmp_path / "a.jsonl", 4)
    path = recipe_file(tmp_path, tiny_model_dir, [{"path": str(data), "weight": weight}, str(data)])
    line = one_error(capsys, RecipeError.exit_code, main(["validate", str(path)]))
    assert "data.path.0.weight" in line or "data.path[0].weight" in line, line


def test_huge_weights_mix_without_overflow(tmp_path, tiny_tokenizer):
    from finetune.data import build_datasets
    from finetune.recipe.schema import DataConfig

    files = [sums_data(tmp_path / f"{n}.jsonl", n) for n in (3, 6)]
    cfg = DataConfig(path=[{"path": str(files[0]), "weight": 1.0e308}, {"path": str(files[1]), "weight": 1.0e308}],
                     max_seq_len=64, validation_split=0.0)
    stats = build_datasets(cfg, tiny_tokenizer, seed=0).stats
    assert [f["used"] for f in stats["files"]] == [3, 3]  # equal weights: as many of each as the smaller holds
    tiny = DataConfig(path=[{"path": str(files[0]), "weight": 5e-324}, {"path": str(files[1]), "weight": 1.0e308}],
                      max_seq_len=64, validation_split=0.0)
    assert [f["used"] for f in build_datasets(tiny, tiny_tokenizer, seed=0).stats["files"]] == [1, 6]


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_file_listed_twice_under_two_names_is_refused_in_one_line(tmp_path, tiny_model_dir, capsys, link):
    """(The same path twice is the recipe schema's own refusal.)"""
    data = sums_data(tmp_path / "a.jsonl", 4)
    twin = tmp_path / "b.jsonl"
    twin.symlink_to(data) if link == "symlink" else os.link(data, twin)
    path = recipe_file(tmp_path, tiny_model_dir, [str(data), str(twin)])
    line = one_error(capsys, RecipeError.exit_code, main(["validate", str(path)]))
    assert "data.path[1]" in line and "is the same file as data.path[0]" in line and "list it once" in line


# ---- 2-4, 8. images that fail to decode, too narrow, with a NUL byte, or null -------------------------------


def narrow() -> dict[str, bytes]:
    return {f"{w}x{h}.png": png((w, h)) for w, h in ((300, 1), (1, 300), (201, 1), (2, 600), (5000, 10))}


def test_images_that_fail_to_decode_are_bad_records_in_validate_run_and_skip(tmp_path, vlm, capsys):
    data = image_records(tmp_path, broken_images())
    path = recipe_file(tmp_path, vlm, data)
    line = one_error(capsys, DataError.exit_code, main(["validate", str(path)]))
    assert f"{data} record 1: image {tmp_path / 'img' / 'corrupt-idat.png'} cannot be decoded" in line, line
    skip = recipe_file(tmp_path, vlm, data, data={"on_bad_record": "skip", "validation_split": 0.0})
    assert main(["validate", str(skip)]) == 0
    assert "5 messages records, 4 malformed to skip" in " ".join(capsys.readouterr().out.split())
    assert main(["run", str(skip)]) == 0, capsys.readouterr().err  # the one good record trains
    assert json.loads((tmp_path / "run" / "data_stats.json").read_text())["bad_records_skipped"] == 4


def test_the_runs_data_build_counts_a_decode_failure_as_a_bad_record(tmp_path, vlm):
    """The build's own check (not only the preflight's): a file broken after validate is skipped and counted."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.data import build_datasets
    from finetune.model.vision import vision_data
    from finetune.recipe.schema import DataConfig

    data = image_records(tmp_path, broken_images())
    tokenizer = AutoTokenizer.from_pretrained(vlm)
    vision = vision_data(AutoConfig.from_pretrained(vlm), vlm, tokenizer)
    bundle = build_datasets(DataConfig(path=str(data), max_seq_len=256, validation_split=0.0, packing=False,
                                       on_bad_record="skip"), tokenizer, seed=0, vision=vision)
    assert bundle.stats["bad_records_skipped"] == 4 and bundle.stats["train_examples"] == 1


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
def test_an_aspect_ratio_over_200_is_a_bad_record_as_a_path_a_part_or_parquet_bytes(tmp_path, vlm, capsys, command):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = image_records(tmp_path, narrow())
    line = one_error(capsys, DataError.exit_code, main([command, str(recipe_file(tmp_path, vlm, data))]))
    assert "is 300x1, an aspect ratio over 200:1" in line, line
    assert not (tmp_path / "run").exists()
    skip = recipe_file(tmp_path, vlm, data, data={"on_bad_record": "skip"})
    assert main([command, str(skip)]) == 0, capsys.readouterr().err
    assert "Traceback" not in capsys.readouterr().err
    parts = [{"messages": [{"role": "user", "content": [{"type": "image", "path": str(tmp_path / "img" / name)},
                                                        {"type": "text", "text": "Colour?"}]}, ANSWER]}
             for name in narrow()]
    (tmp_path / "parts.json").write_text(json.dumps(parts))
    table = pa.table({"messages": [json.dumps([ASK, ANSWER])] * 5, "images": [
        [{"bytes": raw, "path": None}] for raw in narrow().values()]})
    pq.write_table(table, tmp_path / "bytes.parquet")
    for name in ("parts.json", "bytes.parquet"):
        line = one_error(capsys, DataError.exit_code, main(["validate", str(recipe_file(tmp_path, vlm,
                                                                                         tmp_path / name))]))
        assert "an aspect ratio over 200:1" in line, line


def test_a_nul_byte_in_an_image_path_is_a_bad_record(tmp_path, vlm, capsys):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "good.png").write_bytes(png())
    rows = [{"messages": [ASK, ANSWER], "images": ["img/good.png"]},
            {"messages": [ASK, ANSWER], "images": ["img/good.png\u0000evil"]},
            {"messages": [ASK, ANSWER], "images": [f"file://{tmp_path}/img/good.png%00.txt"]}]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(rows))
    line = one_error(capsys, DataError.exit_code, main(["validate", str(recipe_file(tmp_path, vlm, data))]))
    assert "holds a NUL byte" in line and "record 1" in line, line
    assert main(["validate", str(recipe_file(tmp_path, vlm, data, data={"on_bad_record": "skip"}))]) == 0
    assert "3 messages records, 2 malformed to skip" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("images", [[None, "img/good.png"], [None]])
def test_a_null_image_is_a_bad_record_for_vision_and_text_models(tmp_path, vlm, tiny_model_dir, capsys, images):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "good.png").write_bytes(png())
    turn = {"role": "user", "content": "<image>" * len(images) + "Colour?"}
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"messages": [{"role": "user", "content": "Hi"}, ANSWER]},
                                {"messages": [turn, ANSWER], "images": images}]))
    for model in (vlm, tiny_model_dir):
        line = one_error(capsys, DataError.exit_code, main(["validate", str(recipe_file(tmp_path, model, data))]))
        assert "record 1: 'images'[0] is null" in line, line
        skip = recipe_file(tmp_path, model, data, data={"on_bad_record": "skip"})
        assert main(["validate", str(skip)]) == 0  # counted as bad, not trained with an image less
        assert "2 messages records, 1 malformed to skip" in " ".join(capsys.readouterr().out.split())


# ---- 2, 5. generate --image checks its image before any model loads ----------------------------------------


@pytest.fixture(scope="module")
def text_run(tmp_path_factory, tiny_model_dir) -> Path:
    from finetune.recipe import validate_recipe
    from finetune.train.run import run

    folder = tmp_path_factory.mktemp("text-run")
    run(validate_recipe(tiny_lora_recipe(tiny_model_dir, sums_data(folder / "sums.jsonl", 8), folder / "run",
                                         {"training": {"max_steps": 1, "micro_batch_size": 2}})))
    return folder / "run"


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the image must be refused first."""
    import finetune.model.trained as trained

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the image was checked")

    monkeypatch.setattr(trained, "load_model", refuse)
    monkeypatch.setattr(trained, "load_full", refuse)


@pytest.mark.parametrize(("name", "problem"), [
    *[(name, "cannot be decoded") for name in broken_images()],
    ("bomb.png", "decompression-bomb limit"), ("big.png", "decompression-bomb limit"),
    ("300x1.png", "aspect ratio over 200:1")])
def test_generate_refuses_a_bad_image_before_loading_the_model(tmp_path, text_run, no_model, capsys, name, problem):
    files = {**broken_images(), "bomb.png": png_header(100000, 100000), "big.png": png_header(10000, 10000),
             "300x1.png": png((300, 1))}
    (tmp_path / name).write_bytes(files[name])
    line = one_error(capsys, 2, main(["generate", str(text_run), "--prompt", "hi", "--image", str(tmp_path / name)]))
    assert line.startswith(f"error: --image: image {tmp_path / name}") and problem in line, line


def test_generate_names_an_image_path_with_a_nul_byte(text_run, no_model, capsys):
    line = one_error(capsys, 2, main(["generate", str(text_run), "--prompt", "hi", "--image", "img/good.png\x00x"]))
    assert "--image img/good.png\\x00x: no such file" in line


# ---- 6. export to a folder that cannot take it --------------------------------------------------------------


def _json_error(out: str) -> dict:
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert "error" in events[-1], out
    return events[-1]


def test_export_under_a_regular_file_is_one_line_and_a_json_error(tmp_path, text_run, capsys):
    (tmp_path / "file").write_text("x")
    for progress in ([], ["--progress", "json"]):
        result = main(["export", str(text_run), "--out", str(tmp_path / "file" / "merged"), *progress])
        out = capsys.readouterr().out
        assert result == 2
        if progress:
            assert _json_error(out)["exit_code"] == 2
    main(["export", str(text_run), "--out", str(tmp_path / "file" / "merged")])
    line = one_error(capsys, 2, 2)
    assert f"--out {tmp_path / 'file' / 'merged'} cannot be made: {tmp_path / 'file'} is a file" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_export_to_a_read_only_or_full_disk_keeps_the_earlier_export(tmp_path, text_run, capsys, monkeypatch, fault):
    import transformers.modeling_utils as modeling
    from safetensors import SafetensorError

    out = tmp_path / "merged"
    assert main(["export", str(text_run), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes  # the weights readable like every other file
    capsys.readouterr()
    if fault == "read-only":
        real = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self.parent == tmp_path:
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return real(self, *args, **kwargs)
        monkeypatch.setattr(Path, "mkdir", mkdir)
    else:
        def full(*args, **kwargs):
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                                  "\"No space left on device\" })")
        monkeypatch.setattr(modeling, "safe_save_file", full)
    result = main(["export", str(text_run), "--out", str(out), "--progress", "json"])
    captured = capsys.readouterr()
    assert result == (2 if fault == "read-only" else 1) and "Traceback" not in captured.err
    error = _json_error(captured.out)
    assert str(tmp_path) in error["error"] and ("writable disk" in error["error"] if fault == "read-only"
                                                else "ran out of space" in error["error"]), error
    assert [line for line in captured.err.splitlines() if line.startswith("error:")] == \
        [f"error: {error['error'].splitlines()[0]}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no temporary left
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier export kept


@pytest.mark.parametrize(("form", "problem"), [([], "takes no file that large"),  # safetensors: the OS's errno
                                              (["--format", "gguf", "--type", "f32"], "ran out of space")])
def test_an_export_whose_disk_takes_too_little_is_one_line_and_keeps_the_earlier_export(tmp_path, text_run, form,
                                                                                       problem):
    """A real short write, as a full disk (or a FAT32 one, for a file over 4 GiB) makes: the export's own process
    may write no file over 64 KiB (RLIMIT_FSIZE), and the weights are larger. GGUF's writer (numpy) reports the
    short write without an errno."""
    import resource
    import subprocess

    out = tmp_path / "merged"
    assert main(["export", str(text_run), "--out", str(out), *form]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert max(len(data) for data in before.values()) > 64 << 10

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    done = subprocess.run([sys.executable, "-m", "finetune", "export", str(text_run), "--out", str(out), *form,
                           "--progress", "json"], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[1], preexec_fn=small_files)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    error = _json_error(done.stdout)
    assert error["exit_code"] == 1 and error["error"].startswith(f"export: {tmp_path} {problem}"), error
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == \
        [f"error: {error['error'].splitlines()[0]}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no temporary left
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier export kept


# ---- 7, 9. offload folders and MoE-only keys ---------------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
def test_an_offload_dir_name_too_long_is_a_recipe_error(tmp_path, capsys, command):
    path = three_step_recipe(tmp_path, "qwen3_moe", {"memory": {"offload_experts": "disk",
                                                                 "offload_dir": str(tmp_path / ("x" * 300))}})
    line = one_error(capsys, 2, main([command, str(path)]))
    assert "memory.offload_dir" in line and "300 bytes long" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("batch", ["auto", 2])  # the planner chooses it, or the recipe fixes every setting
def test_experts_on_a_disk_without_room_name_the_offload_dir_in_run_and_plan(tmp_path, capsys, monkeypatch, batch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 4096))
    folder = tmp_path / "experts" / "deeper"
    path = three_step_recipe(tmp_path, "qwen3_moe", {"memory": {"offload_experts": "disk", "offload_dir": str(folder)}},
                             {"training": {"micro_batch_size": batch}})
    result = main(["run", str(path)])
    shown = capsys.readouterr()
    assert shown.out.count("nothing was trained") + shown.err.count("nothing was trained") == 1, shown
    capsys.readouterr()
    print(shown.err, file=sys.stderr)
    line = one_error(capsys, 2, result)
    assert f"memory.offload_dir {folder}: nothing fits, expert offload to disk needs" in line, line
    assert not (tmp_path / "run").exists() and not (tmp_path / "experts").exists()
    assert main(["plan", str(path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "set memory.offload_dir to a folder with room" in out and "set memory.gpu_memory" not in out, out


def test_a_missing_offload_dir_is_not_left_behind_by_validate_plan_or_a_run(tmp_path, capsys):
    folder = tmp_path / "off" / "deeper"
    path = three_step_recipe(tmp_path, "qwen3_moe", {"memory": {"offload_experts": "disk", "offload_dir": str(folder)}})
    for command in ("validate", "plan", "run"):
        result = main([command, str(path)])
        err = capsys.readouterr().err
        assert result == 0, err
        assert not (tmp_path / "off").exists(), command
    assert f"of expert weights in files under {folder}" in " ".join(err.split())  # the run did offload there


def test_the_offload_folders_made_go_with_the_files(tmp_path):
    from transformers import AutoModelForCausalLM

    from finetune.memory.expert_offload import offload_experts
    from finetune.memory.offload_disk import check_offload_dir
    from finetune.model.moe import use_finetune_experts
    from finetune.testing import tiny_config

    folder = tmp_path / "a" / "b"
    check_offload_dir(folder, 1 << 10)
    assert not (tmp_path / "a").exists()  # the check makes nothing
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", vocab_size=300))
    use_finetune_experts(model)
    offload = offload_experts(model, "disk", None, folder)
    assert any(folder.iterdir())
    offload.close()
    assert list(tmp_path.iterdir()) == []  # the folders it made are gone with the files


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
def test_offload_experts_on_a_dense_model_is_refused(tmp_path, capsys, command):
    path = three_step_recipe(tmp_path, "llama", {"memory": {"offload_experts": "disk"}})
    line = one_error(capsys, 2, main([command, str(path)]))
    assert "memory.offload_experts: model.path is a Llama 3.x model, not a mixture-of-experts model" in line, line
    assert not (tmp_path / "run").exists()


# ---- 9. images held in the data --------------------------------------------------------------------------


def test_a_cache_that_is_a_file_and_a_non_image_payload_are_one_line(tmp_path, vlm, capsys, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cache = tmp_path / "cache"
    monkeypatch.setenv("FINETUNE_CACHE", str(cache))
    uri = "data:image/png;base64," + base64.b64encode(png()).decode()
    zeros = "data:image/png;base64," + base64.b64encode(bytes(3 << 20)).decode()
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"messages": [ASK, ANSWER], "images": [uri]},
                                {"messages": [ASK, ANSWER], "images": [zeros]}]))
    line = one_error(capsys, DataError.exit_code, main(["validate", str(recipe_file(tmp_path, vlm, data))]))
    assert "record 1: an image held in the data is not an image Pillow can read" in line, line
    assert [p.stat().st_size for p in (cache / "images").rglob("*") if p.is_file()] == [len(png())]  # no zeros kept
    pq.write_table(pa.table({"messages": [json.dumps([ASK, ANSWER])], "images": [[{"bytes": bytes(3 << 20),
                                                                                 "path": None}]]}),
                   tmp_path / "zeros.parquet")
    line = one_error(capsys, DataError.exit_code, main(["validate", str(recipe_file(tmp_path, vlm,
                                                                                     tmp_path / "zeros.parquet"))]))
    assert "record 0: an image held in the data is not an image Pillow can read" in line, line
    assert [p.stat().st_size for p in (cache / "images").rglob("*") if p.is_file()] == [len(png())]
    shutil.rmtree(cache)
    cache.write_text("a file, not a folder")
    line = one_error(capsys, DataError.exit_code, main(["validate", str(recipe_file(tmp_path, vlm, data))]))
    assert "cannot store an image held in the data" in line and "FINETUNE_CACHE" in line, line
    assert cache.read_text() == "a file, not a folder"
