"""Activation offload and chunked loss, side by side in one run: tokens/s and peak memory.

A small random Llama (hidden 256, 4 layers, vocab 32k, LoRA r=16 all-linear), micro-batch 1, seq 1024, the
same batch for every configuration: checkpointing alone, + CPU offload, + disk offload, + chunked loss; the
same without checkpointing, where far more bytes move. Two synchronous disk offloads to compare the disk
tier with: "naive hooks" is the plain saved_tensors_hooks one writes first (torch.save every saved tensor
of at least offload_min_size in pack, torch.load it in unpack, on the compute thread); "sync, same tensors"
plugs synchronous raw I/O into our hooks, so only the overlap differs. On a CPU-only machine the cpu tier
keeps tensors where they are (RAM is the training device's memory): its row measures the hooks' overhead.

Timing: configurations run round-robin in this process (best of the rounds, so load on the shared machine
hits all of them alike). Peak memory: on CUDA `max_memory_allocated`; on CPU a child process measures each
configuration's peak RSS above the RSS before the step (VmHWM reset through /proc/self/clear_refs, glibc's
mmap threshold pinned so that freed tensors leave RSS -- which slows big allocations, hence not timed).

    PYTHONPATH=. python benchmarks/offload.py > benchmarks/results/offload-cpu.txt
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from finetune.memory.chunked_loss import causal_lm_loss
from finetune.memory.offload import ActivationOffload
from finetune.memory.offload_disk import read_tensor_file, write_tensor_file
from finetune.memory.offload_tier import SpillChain
from finetune.model.family import decoder_layers
from finetune.testing import tiny_config

MIN_SIZE = 64 << 10
MMAP_THRESHOLD = "65536"


class NaiveHooks(torch.autograd.graph.saved_tensors_hooks):
    """torch.save each saved tensor >= min_size (parameters aside) in pack; torch.load and delete in unpack."""

    def __init__(self, model: torch.nn.Module, directory: Path, min_size: int):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        counter = itertools.count()
        directory.mkdir(parents=True, exist_ok=True)

        def pack(t: torch.Tensor):
            if (type(t) is not torch.Tensor or t.numel() * t.element_size() < min_size
                    or t.untyped_storage().data_ptr() in params):
                return t
            path = directory / f"naive-{next(counter)}.pt"
            torch.save(t.detach().clone(), path)  # a copy: saving a view would write its whole base
            return path

        def unpack(saved):
            if not isinstance(saved, Path):
                return saved
            tensor = torch.load(saved, map_location=self.device)
            saved.unlink()
            return tensor

        self.device = next(model.parameters()).device
        super().__init__(pack, unpack)


class _SyncFile:
    """Synchronous raw I/O on the compute thread, for our hooks' choice of tensors."""

    def __init__(self, path: Path, tensor: torch.Tensor, layout: torch.Tensor, nbytes: int):
        self.path, self.layout, self.loaded = path, layout, None
        write_tensor_file(path, torch.empty_strided(layout.shape, layout.stride(), dtype=layout.dtype).copy_(tensor))

    def fetch(self) -> None:
        pass

    def get(self) -> torch.Tensor:
        if self.loaded is None:  # several views may be unpacked from one stored storage
            self.loaded = torch.empty_strided(self.layout.shape, self.layout.stride(), dtype=self.layout.dtype)
            read_tensor_file(self.path, self.loaded)
            self.path.unlink()
        return self.loaded

    def release(self) -> None:
        self.loaded = None
        self.path.unlink(missing_ok=True)


class SyncDisk:
    """Stands in for DiskTier (an OffloadTier)."""

    def __init__(self, directory: Path):
        self.directory, self.count = directory, itertools.count()
        directory.mkdir(parents=True, exist_ok=True)

    def store(self, tensor, layout, nbytes) -> _SyncFile:
        return _SyncFile(self.directory / f"sync-{next(self.count)}.bin", tensor, layout, nbytes)

    def drain(self) -> None:
        for path in self.directory.glob("sync-*.bin"):
            path.unlink()

    def close(self) -> None:
        self.drain()


def sync_offload(model, directory: Path) -> ActivationOffload:
    offload = ActivationOffload(model, "disk", MIN_SIZE, offload_dir=directory)
    offload.chain.close()
    offload.chain = SpillChain([("sync", SyncDisk(directory))])
    return offload


# name: (checkpointing, offload, chunked loss)
CONFIGS = {
    "ckpt": (True, None, False),
    "ckpt + cpu offload": (True, "cpu", False),
    "ckpt + disk offload": (True, "disk", False),
    "ckpt + chunked loss": (True, None, True),
    "ckpt + disk + chunked": (True, "disk", True),
    "ckpt + naive hooks": (True, "naive", False),
    "no ckpt": (False, None, False),
    "no ckpt + disk offload": (False, "disk", False),
    "no ckpt + sync, same tensors": (False, "sync", False),
    "no ckpt + naive hooks": (False, "naive", False),
}


def build(device: torch.device, seq: int):
    """LoRA on a random small Llama, and one fixed batch."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model.train()
    ids = torch.randint(4, 32000, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    return model, {"input_ids": ids, "labels": ids}


def make_offloads(model, root: Path) -> dict:
    offloads = {}
    for name, (_, kind, _) in CONFIGS.items():
        if kind == "naive":
            offloads[name] = NaiveHooks(model, root / "naive", MIN_SIZE)
        elif kind == "sync":
            offloads[name] = sync_offload(model, root / "sync")
        elif kind is not None:
            offloads[name] = ActivationOffload(model, kind, MIN_SIZE, offload_dir=root / "disk")
    return offloads


def one_step(model, batch, name: str, offloads: dict) -> None:
    checkpointing, _, chunked = CONFIGS[name]
    for layer in decoder_layers(model):
        layer.gradient_checkpointing = checkpointing
    model.zero_grad(set_to_none=True)
    offload = offloads.get(name)
    if offload is None:
        run_loss(model, batch, chunked)
    else:
        with offload:
            run_loss(model, batch, chunked)
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def run_loss(model, batch, chunked: bool) -> None:
    loss = causal_lm_loss(model, batch) if chunked else model(**batch).loss
    loss.backward()


def _status_mib(field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def peak_mib(model, batch, name: str, offloads: dict) -> float:
    """Peak memory of one step above what was live before it."""
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        one_step(model, batch, name, offloads)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_mib("VmRSS")
    one_step(model, batch, name, offloads)
    return _status_mib("VmHWM") - base


def close(offloads: dict) -> None:
    for offload in offloads.values():
        if isinstance(offload, ActivationOffload):
            offload.close()


def measure_peaks(args) -> dict[str, float]:
    """On CPU in a child with a pinned mmap threshold (see the module docstring); on CUDA here."""
    if args.device != "cpu":
        return peaks_here(args)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    out = subprocess.run([sys.executable, __file__, "--peaks-only", "--seq", str(args.seq), "--device", "cpu"],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def peaks_here(args) -> dict[str, float]:
    model, batch = build(torch.device(args.device), args.seq)
    offloads = make_offloads(model, Path(tempfile.mkdtemp(prefix="bench-offload-")))
    peaks = {}
    for name in CONFIGS:
        one_step(model, batch, name, offloads)  # warm-up
        peaks[name] = max(peak_mib(model, batch, name, offloads) for _ in range(2))
    close(offloads)
    return peaks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--offload-dir", default=None, help="disk tier folder (default: a temp dir)")
    parser.add_argument("--peaks-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peaks_only:
        print(json.dumps(peaks_here(args)))
        return 0
    device = torch.device(args.device)
    model, batch = build(device, args.seq)
    offloads = make_offloads(model, Path(args.offload_dir or tempfile.mkdtemp(prefix="bench-offload-")))
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name in CONFIGS:
            start = time.perf_counter()
            one_step(model, batch, name, offloads)
            if round_:
                times[name].append(time.perf_counter() - start)
    steps = args.rounds + 1
    moved = {name: f"{off.stats['offloaded_bytes'] / steps / 2**20:.1f}" for name, off in offloads.items()
             if isinstance(off, ActivationOffload)}
    close(offloads)
    peaks = measure_peaks(args)

    tokens = batch["input_ids"].numel()
    speed = {name: tokens / min(t) for name, t in times.items()}
    print(f"# PYTHONPATH=. python benchmarks/offload.py --device {args.device} --seq {args.seq} --rounds {args.rounds}")
    print(f"# {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__},"
          f" {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; LoRA r=16 on Llama hidden 256 x 4 layers,"
          f" vocab 32000, micro-batch 1 x {args.seq} tokens, offload_min_size {MIN_SIZE >> 10} KiB")
    print("# tokens/s: best of the rounds; peak MiB: above the memory live before the step; "
          "offloaded MiB: per step, by our hooks")
    print(f"{'configuration':<30}{'tokens/s':>10}{'vs ref':>8}{'peak MiB':>10}{'vs ref':>8}{'offloaded MiB':>15}")
    for name in CONFIGS:
        ref = "no ckpt" if name.startswith("no ckpt") else "ckpt"
        print(f"{name:<30}{speed[name]:>10.0f}{speed[name] / speed[ref]:>7.2f}x"
              f"{peaks[name]:>10.1f}{peaks[name] / peaks[ref]:>7.2f}x{moved.get(name, '-'):>15}")
    ok = True
    for mode in ("ckpt", "no ckpt"):
        ratio = speed[f"{mode} + disk offload"] / speed[f"{mode} + naive hooks"]
        ok &= ratio > 1
        print(f"{mode}: disk tier at {ratio:.2f}x the tokens/s of the naive hooks -- {'OK' if ratio > 1 else 'FAIL'}")
    ratio = speed["no ckpt + disk offload"] / speed["no ckpt + sync, same tensors"]
    print(f"no ckpt: disk tier at {ratio:.2f}x the tokens/s of synchronous I/O on the same tensors")
    if device.type == "cuda":
        for name, floor in (("ckpt + cpu offload", 0.95), ("ckpt + disk offload", 0.85)):
            ratio = speed[name] / speed["ckpt"]
            ok &= ratio >= floor
            print(f"{name}: {ratio:.3f}x checkpointing alone (target >= {floor}) -- {'OK' if ratio >= floor else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
