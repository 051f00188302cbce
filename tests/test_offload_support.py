"""Shared pieces of the offload tests: the tiny models (full, LoRA, QLoRA), one step, a live-bytes counter."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from finetune.memory.offload import ActivationOffload

LAYERS, BATCH, SEQ = 4, 2, 32


def make_model_dir(tmp_path_factory) -> Path:
    """A 4-layer tiny Llama (the shared fixture has 2: too few to see layer-by-layer offload).

    Test modules use it as `model_dir = pytest.fixture(scope="module")(make_model_dir)`.
    """
    from finetune.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("offload-llama"), num_hidden_layers=LAYERS)


def load(model_dir: Path, adapter: str = "full", checkpointing: bool = False) -> torch.nn.Module:
    """The tiny model for full fine-tuning, LoRA, or QLoRA (NF4 base, 4-bit repack disabled)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = None
    if adapter == "qlora":
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=quant)
    if adapter in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        from finetune.model.load import disable_cpu_4bit_repack

        disable_cpu_4bit_repack(model)
        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(4, 300, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def step(model: torch.nn.Module, offload: ActivationOffload | None = None) -> list[torch.Tensor]:
    """One forward + backward (inside the offload context when given); returns the trainable grads."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # same dropout masks in every run
    if offload is None:
        model(**batch()).loss.backward()
    else:
        with offload:
            model(**batch()).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages that ops return while active (not the model's), and the peak."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.current = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._model = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._refs and key not in self._model and storage.nbytes():
                    nbytes = storage.nbytes()
                    self._refs[key] = weakref.ref(storage, lambda _r, k=key, n=nbytes: self._free(k, n))
                    self.current += nbytes
                    self.peak = max(self.peak, self.current)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.current -= nbytes


def files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []
