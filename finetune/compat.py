"""Every private torch / transformers API finetune uses, behind one name each, with the versions it was checked on.

Why: a private name (`torch.utils._pytree`, `config._attn_implementation`) may change in any release without
notice. Gathered here, an upgrade is checked in one file: `CHECKED` gives, per library, the oldest and newest
version (major.minor) its private APIs were checked on; it is the one table behind pyproject's version bounds
(tests/test_lock.py) and `.ci/lock.py upgrade` widens it when the suite passes on a new release. `PRIVATE`
names each API. Outside the checked range the API is still tried, and the command prints one plain line
naming the libraries, their checked ranges and the command that installs the tested versions
(`constraints.txt`, the lock file); where an API is gone the run stops with one line saying which API,
which versions work and what to install (exit code 1, no traceback), or a public fallback takes over where
one exists (`op_schema`, `supports_sdpa`). tests/test_compat.py checks each entry against the installed
versions and that no other module reaches for these names. Training runs its own loop
(finetune/train/loop.py), so no transformers.Trainer method, private or public, is overridden anywhere.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from finetune.errors import FinetuneError


def _minor(text: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.13.0+cpu" -> (2, 13)."""
    parts = (text.split("+")[0].split(".") + ["0"])[:2]
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


# The versions (major.minor, both ends included) each library's private APIs were checked on: the oldest is
# pyproject's floor, the newest the version in constraints.txt. pyproject's upper bounds are derived from this
# table (newest + one minor), torch excepted: a GPU user's own CUDA build must not be replaced by pip.
CHECKED: dict[str, tuple[str, str]] = {
    "torch": ("2.4", "2.13"),
    "transformers": ("5.23", "5.25"),
    "accelerate": ("1.5", "1.16"),
    "peft": ("0.17", "0.21"),
    "trl": ("0.20", "1.16"),
}
LOCK = Path(__file__).with_name("constraints.txt")  # the tested versions, written by `.ci/lock.py freeze`


@dataclass(frozen=True)
class PrivateAPI:
    """One private API: what finetune uses (`name`, as the library spells it), from which `library` (checked on
    the versions `CHECKED` gives for it), and what happens outside them."""

    name: str
    library: str
    outside: str = "tried; an error naming it where it is gone"

    @property
    def oldest(self) -> str:
        return CHECKED[self.library][0]

    @property
    def newest(self) -> str:
        return CHECKED[self.library][1]

    def installed(self) -> str:
        try:
            return version(self.library)
        except PackageNotFoundError:
            return "none"

    def checked(self, installed: str | None = None) -> bool:
        """Whether the installed (or given) version lies in the range this API was checked on."""
        text = installed or self.installed()
        return text != "none" and _minor(self.oldest) <= _minor(text) <= _minor(self.newest)

    def missing(self) -> FinetuneError:
        """The error when the API is gone: which one, which versions have it, what to install."""
        major, minor = _minor(self.newest)
        return FinetuneError(f"{self.library} {self.installed()} lacks {self.name}, which finetune uses (checked on "
                             f"{self.library} {self.oldest} to {self.newest})",
                             hint=f"install {self.library}>={self.oldest},<{major}.{minor + 1} or a finetune that "
                                  "supports this version")


PRIVATE: dict[str, PrivateAPI] = {api.name: api for api in (
    PrivateAPI("torch.utils._python_dispatch.TorchDispatchMode", "torch"),
    PrivateAPI("torch.utils._pytree", "torch"),
    PrivateAPI("torch.autograd.graph._engine_run_backward", "torch"),
    PrivateAPI("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu", "torch"),
    PrivateAPI("torch._foreach_norm", "torch", "falls back to one torch.linalg.vector_norm per tensor"),
    PrivateAPI("OpOverload._schema", "torch", "falls back to no schema: the meta memo is off"),
    PrivateAPI("UntypedStorage._cdata", "torch"),
    PrivateAPI("Tensor._version", "torch"),
    PrivateAPI("PretrainedConfig._attn_implementation", "transformers"),
    PrivateAPI("PreTrainedModel._supports_sdpa", "transformers",
               "falls back to sdpa (what transformers picks when it is not told)"),
    PrivateAPI("PreTrainedModel._supports_flash_attn", "transformers",
               "falls back to not supported: auto does not pick flash_attention_2"),
    PrivateAPI("PreTrainedModel._supports_flex_attn", "transformers",
               "falls back to not supported: auto does not pick flex_attention"),
    PrivateAPI("PreTrainedModel._supports_attention_backend", "transformers",
               "falls back to not supported: auto does not pick a registered attention function (chunked)"),
    PrivateAPI("AcceleratorState._reset_state", "accelerate"),
    PrivateAPI("use_experts_implementation._apply_gate", "transformers"),
    PrivateAPI("Tensor._make_wrapper_subclass", "torch"),
    PrivateAPI("torch._C._disabled_torch_function_impl", "torch"),
    PrivateAPI("torch._dynamo.utils.counters", "torch", "falls back to no count: graph breaks are not reported"),
    # modules a library does not export from its top level: imported here only, each through one function
    PrivateAPI("trl.trainer.sft_trainer.DataCollatorForLanguageModeling", "trl"),
    PrivateAPI("transformers.models.mllama.processing_mllama", "transformers"),
    PrivateAPI("transformers.models.mllama.image_processing_pil_mllama", "transformers"),
    PrivateAPI("peft.utils.transformers_weight_conversion", "peft"),
)}
_seen: set[str] = set()  # entries whose version was compared this process (hot paths call _use per tensor)
_noted = False  # the one line on untested versions was printed (once per process: once per command)


def tested_versions(lock: Path = LOCK) -> dict[str, str]:
    """The lock file's pins, {normalized name: version}: what the suite last passed on."""
    pins = {}
    for line in lock.read_text().splitlines() if lock.exists() else []:
        name, sep, pinned = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[name.strip().lower()] = pinned.strip()
    return pins


def untested_note() -> str | None:
    """One plain line naming each library installed outside its checked range, or None for a tested install:
    what is installed, what was checked, and the one command that installs the tested versions."""
    outside = [lib for lib in CHECKED if not PrivateAPI("", lib).checked()]
    if not outside:
        return None
    pins = tested_versions()
    found = ", ".join(f"{lib} {PrivateAPI('', lib).installed()} (checked on {CHECKED[lib][0]} to {CHECKED[lib][1]})"
                      for lib in outside)
    command = " ".join(f"{lib}=={pins[lib]}" for lib in outside if lib in pins)
    fix = f"; the tested versions: pip install {command}" if command else ""
    return f"note: finetune was not tested with {found}; it tries them{fix}"


def _use(name: str) -> PrivateAPI:
    """The entry of `name`; the first time this process uses an API of an untested version, one line on stderr."""
    global _noted
    api = PRIVATE[name]
    if name not in _seen:
        _seen.add(name)
        if not _noted and not api.checked():
            _noted = True
            print(untested_note(), file=sys.stderr)
    return api


def check_all() -> list[str]:
    """Each private API whose library's installed version is outside its checked range, as one line."""
    return [f"{a.name}: checked on {a.library} {a.oldest} to {a.newest}, installed {a.installed()}"
            for a in PRIVATE.values() if not a.checked()]


try:  # the tracker's and the planner's base class, and the pytree walk over an op's arguments
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
except ImportError:
    raise PRIVATE["torch.utils._python_dispatch.TorchDispatchMode"].missing() from None
_use("torch.utils._python_dispatch.TorchDispatchMode")
_use("torch.utils._pytree")
__all__ = ["CHECKED", "LOCK", "PRIVATE", "PrivateAPI", "TorchDispatchMode", "attn_implementation", "check_all",
           "engine_backward", "expert_gate", "flash_attention_cpu", "foreach_norm", "lm_collator", "meta_on_device",
           "mllama_processing", "model_supports", "op_schema", "peft_moe_conversion", "set_attn_implementation",
           "storage_id", "supports_sdpa", "tensor_version", "tested_versions", "tree_flatten", "tree_leaves", "tree_map",
           "untested_note"]


def engine_backward(loss: torch.Tensor) -> None:
    """loss.backward() without entering torch's function dispatch (a TorchFunctionMode is off inside its own
    handler, and the checkpointed layers' forward that backward recomputes must see it)."""
    api = _use("torch.autograd.graph._engine_run_backward")
    try:
        from torch.autograd.graph import _engine_run_backward
    except ImportError:
        raise api.missing() from None
    _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)


def flash_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, is_causal: bool,
                        attn_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """The fused attention kernel's output (on `meta`: its shapes, without the s x s probabilities)."""
    api = _use("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu")
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        raise api.missing()
    return op(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor in float32, in one fused call where torch has it."""
    _use("torch._foreach_norm")
    fused = getattr(torch, "_foreach_norm", None)
    if fused is None:
        return [torch.linalg.vector_norm(t, 2, dtype=torch.float32) for t in tensors]
    return list(fused(tensors, 2, dtype=torch.float32))


def op_schema(func: Any) -> Any:
    """An aten op's schema (`is_mutable`, arguments' `alias_info`), or None where torch does not give it."""
    _use("OpOverload._schema")
    return getattr(func, "_schema", None)


def storage_id(storage: torch.UntypedStorage) -> int:
    """Which storage (identity that outlives the Python object: views of one tensor share it)."""
    api = _use("UntypedStorage._cdata")
    try:
        return storage._cdata
    except AttributeError:
        raise api.missing() from None


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter (changes when its data is written in place)."""
    api = _use("Tensor._version")
    try:
        return tensor._version
    except AttributeError:
        raise api.missing() from None


def graph_breaks() -> int | None:
    """How many graph breaks torch.compile has met in this process so far (0 where nothing was compiled, None
    where torch does not say). Imports nothing: dynamo is loaded once something was compiled."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    _use("torch._dynamo.utils.counters")
    counters = getattr(utils, "counters", None)
    return None if counters is None else sum(counters["graph_break"].values())


def attn_implementation(config: Any) -> str | None:
    """The attention kernel a transformers config asks for (eager, sdpa, flash_attention_2, ...)."""
    api = _use("PretrainedConfig._attn_implementation")
    try:
        return config._attn_implementation
    except AttributeError:
        raise api.missing() from None


def set_attn_implementation(config: Any, attn: str) -> None:
    """Make a config (before its model is built) use the attention kernel `attn`."""
    api = _use("PretrainedConfig._attn_implementation")
    if not hasattr(config, "_attn_implementation"):
        raise api.missing()
    config._attn_implementation = attn


def expert_gate(experts: Any, gate_up: torch.Tensor) -> torch.Tensor:
    """A fused-experts module's gating of its gate_up projection (the layout transformers'
    `use_experts_implementation` gives it: halves, or gpt-oss's interleaved clamped SwiGLU)."""
    api = _use("use_experts_implementation._apply_gate")
    gate = getattr(experts, "_apply_gate", None)
    if gate is None:
        raise api.missing()
    return gate(gate_up)


class _MetaOnDevice(torch.Tensor):
    """A meta tensor that reports another device (see `meta_on_device`). Every op runs on the meta tensor; an
    output sharing its storage (a view, detach, which nn.Parameter calls, set_) keeps the disguise, so it
    stays a weight and not a new tensor to a tracker on `meta`; any other output is a plain meta tensor."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: str):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   storage_offset=inner.storage_offset(),
                                                   device=torch.device(device), requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor, device: str):
        self.inner, self.reported = inner, device

    def __repr__(self) -> str:
        return f"meta_on_device({self.inner!r}, {self.reported!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        flat, spec = tree_flatten((args, kwargs or {}))
        ours = [t for t in flat if isinstance(t, cls)]
        storages = {storage_id(t.inner.untyped_storage()) for t in ours}
        args, kwargs = tree_unflatten([t.inner if isinstance(t, cls) else t for t in flat], spec)
        out, out_spec = tree_flatten(func(*args, **kwargs))
        return tree_unflatten([cls(t, ours[0].reported) if isinstance(t, torch.Tensor) and t.is_meta
                               and storage_id(t.untyped_storage()) in storages else t for t in out], out_spec)

    __torch_function__ = torch._C._disabled_torch_function_impl


def meta_on_device(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """`tensor` (on `meta`) as a tensor whose `.device` says `device`, still holding no memory: for library
    code that reads a weight's device type to open a context `meta` has none of (peft's LoRA on fused expert
    weights switches autocast off on its weight's device; autocast has no meta device)."""
    _use("Tensor._make_wrapper_subclass")
    _use("torch._C._disabled_torch_function_impl")
    if not hasattr(torch.Tensor, "_make_wrapper_subclass"):
        raise PRIVATE["Tensor._make_wrapper_subclass"].missing()
    return _MetaOnDevice(tensor, device)


def supports_sdpa(model_class: type | None) -> bool:
    """Whether a transformers model class runs torch's scaled_dot_product_attention (unknown: yes)."""
    _use("PreTrainedModel._supports_sdpa")
    return model_class is None or bool(getattr(model_class, "_supports_sdpa", True))


def model_supports(model_class: type | None, flag: str | None) -> bool:
    """Whether a transformers model class declares the attention implementation behind `flag` (its class flag:
    `_supports_sdpa`, `_supports_flash_attn`, `_supports_flex_attn`, `_supports_attention_backend` for a
    registered function); None: needs no flag. An unknown class (None) runs sdpa only."""
    if flag is None:
        return True
    if flag == "_supports_sdpa":
        return supports_sdpa(model_class)
    _use(f"PreTrainedModel.{flag}")
    return model_class is not None and bool(getattr(model_class, flag, False))


def fresh_accelerator_state() -> None:
    """Forget the mixed precision an earlier Accelerator of this process set (another run, a TRL trainer in
    the same process), so the next Accelerator takes this run's; the process group (PartialState) stays.
    accelerate refuses a second Accelerator with other settings otherwise (the transformers Trainer resets it
    the same way)."""
    _use("AcceleratorState._reset_state")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def _module(name: str, entry: str | None = None) -> Any:
    """A library module not exported from its top level (the PRIVATE entry `entry`, by default the module
    itself), or its `missing` error."""
    import importlib

    api = _use(entry or name)
    try:
        return importlib.import_module(name)
    except ImportError:
        raise api.missing() from None


def lm_collator() -> type:
    """trl's padding-free language-model collator (DataCollatorForLanguageModeling, which trl exports only from
    its SFT trainer's module): the base of finetune.data.packing's collators."""
    name = "trl.trainer.sft_trainer.DataCollatorForLanguageModeling"
    collator = getattr(_module(name.rpartition(".")[0], name), "DataCollatorForLanguageModeling", None)
    if collator is None:
        raise PRIVATE[name].missing()
    return collator


def mllama_processing() -> tuple[Any, Any, Any]:
    """Llama 3.2 Vision's processor helpers the collator builds its cross-attention inputs with, as
    MllamaProcessor does: (get_all_supported_aspect_ratios, get_cross_attention_token_mask,
    convert_sparse_cross_attention_mask_to_dense)."""
    images = _module("transformers.models.mllama.image_processing_pil_mllama")
    processing = _module("transformers.models.mllama.processing_mllama")
    try:
        return (images.get_all_supported_aspect_ratios, processing.get_cross_attention_token_mask,
                processing.convert_sparse_cross_attention_mask_to_dense)
    except AttributeError:
        raise PRIVATE["transformers.models.mllama.processing_mllama"].missing() from None


def peft_moe_conversion() -> Any:
    """peft's conversion of a LoraConfig for transformers' fused mixture-of-experts weights
    (convert_peft_config_for_transformers)."""
    conversion = _module("peft.utils.transformers_weight_conversion")
    try:
        return conversion.convert_peft_config_for_transformers
    except AttributeError:
        raise PRIVATE["peft.utils.transformers_weight_conversion"].missing() from None
