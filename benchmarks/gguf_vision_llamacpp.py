"""GGUF export of each vision-language family, loaded by llama.cpp itself: a one-step LoRA run of the tiny model
(tests/test_gguf_vision.py's fixtures) exported with `finetune export --format gguf` (f32, f16, q8_0), the language
model's file and the projector file loaded by llama.cpp's multimodal library (libmtmd, through the
llama-cpp-py-sync wheel), one random image encoded, and llama.cpp's image embeddings and its logits after the image
and a prompt compared with transformers'. Also the two toy settings where llama.cpp itself departs from
transformers (Qwen2.5-VL's RMSNorm epsilon, Qwen3-VL's interleaved rotary sections), to show by how much.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/gguf_vision_llamacpp.py > benchmarks/results/gguf_vision_llamacpp.txt
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from importlib import metadata, resources
from pathlib import Path

from tests.test_gguf_vision import (
    GEMMA3_TEXT,
    LLAMA_CPP_IMAGE,
    MISTRAL3_TEXT,
    QWEN3VL_TEXT,
    QWEN25VL_TEXT,
    _mtmd,
    _trained_run,
    llama_cpp_comparison,
)

# (label, model_type, text config overrides, GGUF types): the tests' runs, then the toy settings llama.cpp
# departs at
TYPES = ("f32", "f16", "q8_0")
RUNS = [
    ("qwen2_5_vl", "qwen2_5_vl", QWEN25VL_TEXT, TYPES),
    ("gemma3", "gemma3", GEMMA3_TEXT, TYPES),
    ("qwen3_vl", "qwen3_vl", QWEN3VL_TEXT, TYPES),
    ("idefics3", "idefics3", {}, TYPES),
    ("smolvlm", "smolvlm", {}, ("f32",)),
    ("mistral3 (mistral)", "mistral3", MISTRAL3_TEXT["mistral"], TYPES),
    ("mistral3 (ministral3)", "mistral3", MISTRAL3_TEXT["ministral3"], TYPES),
    ("qwen2_5_vl rms_norm_eps 1e-5", "qwen2_5_vl", {}, ("f32",)),
    ("qwen3_vl mrope [2,3,3]", "qwen3_vl", {}, ("f32",)),
]


class _Folders:
    """tmp_path_factory's mktemp, under one temporary folder."""

    def __init__(self, root: Path) -> None:
        self.root, self.count = root, 0

    def mktemp(self, name: str) -> Path:
        self.count += 1
        folder = self.root / f"{name}{self.count}"
        folder.mkdir()
        return folder


def main() -> int:
    libs, why = _mtmd()
    if libs is None:
        print(why)
        return 1
    package = resources.files("llama_cpp_py_sync")
    commit = json.loads((package / "native_manifest.json").read_text())["llama_cpp_commit"]
    print(f"# llama.cpp {commit[:9]} (llama-cpp-py-sync {metadata.version('llama-cpp-py-sync')}), one random "
          "image, the prompt 'What colour is the shape?' after it")
    print("# emb: max |llama.cpp - transformers| of the image embeddings / their max |value|; other image: max "
          "|transformers(image) - transformers(another image)|;")
    print("# logits: the last position's, max |difference| / max |value|; lm only: llama.cpp's language model given "
          "transformers' image embeddings")
    print(f"{'model':30s} {'type':4s} {'image':>7s} {'tokens':>6s} {'emb diff':>9s} {'max|emb|':>9s} {'other image':>11s} "
          f"{'logit diff':>10s} {'max|logit|':>10s} {'lm only':>9s}")
    with tempfile.TemporaryDirectory() as tmp:
        folders = _Folders(Path(tmp))
        for label, arch, overrides, qtypes in RUNS:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                run_dir = _trained_run(folders, arch, **overrides)
            for qtype in qtypes:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    r = llama_cpp_comparison(run_dir, folders.mktemp("gguf") / "out", qtype=qtype)
                width, height = LLAMA_CPP_IMAGE[arch]
                print(f"{label:30s} {qtype:4s} {width:>3d}x{height:<3d} {r['tokens']:>6d} {r['error']:9.2e} {r['scale']:9.3f} "
                      f"{r['other_image']:11.3f} {r['logits_error']:10.2e} {r['logits_scale']:10.3f} "
                      f"{r['language_model_error']:9.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
