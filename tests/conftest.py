"""Shared fixtures. Tests are offline: no hub, no downloads."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_HF_HOME = tempfile.mkdtemp(prefix="finetune-test-hf-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HOME"] = _HF_HOME
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("FINETUNE_CACHE", str(Path(_HF_HOME) / "finetune-cache"))
if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n auto`: one worker per core, so one torch thread per worker
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels (Liger's, with the cuda extra) run on a CPU only in Triton's interpreter, which Triton reads
    # once, when this process first imports it: whichever test does (TRL, peft through bitsandbytes), not only
    # the kernel tests, so it is set for the whole session.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from finetune.console import LIBRARY_WARNINGS  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """The library warnings no user can act on, ignored as the CLI and the UI ignore them
    (finetune.console.filter_library_warnings): as filterwarnings lines, since pytest sets each test's filters
    afresh from those."""
    for category, message, module in LIBRARY_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{message}:{category.__name__}:{module}")

@pytest.fixture(autouse=True)
def _default_dtype_kept():
    """torch's default dtype is process-wide: a test that leaves it changed fails here, by name, instead of
    every later test in its worker failing on tensors built in the wrong dtype."""
    import torch

    yield
    left = torch.get_default_dtype()
    if left != torch.float32:
        torch.set_default_dtype(torch.float32)
        pytest.fail(f"this test left torch's default dtype at {left} (every later test in the worker would "
                    "build in it)")


SHARED_DATASETS = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a trained byte-level BPE tokenizer, saved as safetensors."""
    from finetune.testing import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def shared_datasets() -> Path:
    if not SHARED_DATASETS.is_dir():
        pytest.skip(f"shared sample datasets not found at {SHARED_DATASETS} (CI places ../shared beside the repo)")
    return SHARED_DATASETS
