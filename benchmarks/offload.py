"""Activation offload and chunked loss, side by side in one run: tokens/s and peak memory.

A small random Llama (hidden 256, 4 layers, vocab 32k, LoRA r=16 all-linear), micro-batch 1, seq 1024, the
same batch for every configuration: checkpointing alone, + CPU offload, + disk offload, + chunked loss, and
a naive synchronous disk offload (saved_tensors_hooks writing and reading in line, same tensors) to compare
the disk tier with; the same without checkpointing, where far more bytes move (the pass/fail check of the
disk tier against the naive one uses that pair: with checkpointing a few MiB move and both costs are within
the noise). Configurations are timed round-robin, best of the rounds, so load on the machine (shared CPUs)
hits all of them alike.

Peak memory: on CUDA `max_memory_allocated`; on CPU the process's peak RSS above its RSS before the step
(VmHWM reset through /proc/self/clear_refs; glibc's mmap threshold is pinned so freed tensors leave RSS).

    PYTHONPATH=. python benchmarks/offload.py > benchmarks/results/offload-cpu.txt
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

if "MALLOC_MMAP_THRESHOLD_" not in os.environ and sys.platform == "linux":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # must be set before the allocator starts: re-exec
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402

from finetune.memory.chunked_loss import causal_lm_loss  # noqa: E402
from finetune.memory.offload import ActivationOffload, decoder_layers  # noqa: E402
from finetune.memory.offload_disk import read_tensor_file, write_tensor_file  # noqa: E402
from finetune.testing import tiny_config  # noqa: E402

MIN_SIZE = 64 << 10


class _SyncFile:
    """The naive way: write in pack, read in unpack, both on the compute thread."""

    def __init__(self, path: Path, tensor: torch.Tensor, layout: torch.Tensor, nbytes: int):
        self.path, self.layout, self.loaded = path, layout, None
        source = torch.empty_strided(layout.shape, layout.stride(), dtype=layout.dtype).copy_(tensor)
        write_tensor_file(path, source)

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
    """Stands in for DiskTier: same tensors chosen, synchronous I/O."""

    def __init__(self, directory: Path):
        self.directory, self.count = directory, 0

    def store(self, tensor, layout, nbytes) -> _SyncFile:
        self.count += 1
        return _SyncFile(self.directory / f"naive-{self.count}.bin", tensor, layout, nbytes)

    def cleanup(self) -> None:
        for path in self.directory.glob("naive-*.bin"):
            path.unlink()

    def close(self) -> None:
        self.cleanup()


def naive_offload(model, directory: Path) -> ActivationOffload:
    offload = ActivationOffload(model, "disk", MIN_SIZE, offload_dir=directory)
    offload.disk.close()
    offload.disk = SyncDisk(directory)
    return offload


def _status_mib(field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


class Peak:
    """Peak memory of one step above what was live before it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = _status_mib("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.mib = torch.cuda.max_memory_allocated() / 2**20 - self.base
        else:
            self.mib = _status_mib("VmHWM") - self.base


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


# name: (checkpointing, offload, chunked loss)
CONFIGS = {
    "ckpt": (True, None, False),
    "ckpt + cpu offload": (True, "cpu", False),
    "ckpt + disk offload": (True, "disk", False),
    "ckpt + naive sync disk": (True, "naive", False),
    "ckpt + chunked loss": (True, None, True),
    "ckpt + disk + chunked": (True, "disk", True),
    "no ckpt": (False, None, False),
    "no ckpt + disk offload": (False, "disk", False),
    "no ckpt + naive sync disk": (False, "naive", False),
}


def one_step(model, batch, checkpointing: bool, offload, chunked: bool) -> None:
    for layer in decoder_layers(model):
        layer.gradient_checkpointing = checkpointing
    model.zero_grad(set_to_none=True)
    with offload if offload is not None else _nothing():
        loss = causal_lm_loss(model, batch) if chunked else model(**batch).loss
        loss.backward()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--offload-dir", default=None, help="disk tier folder (default: a temp dir)")
    args = parser.parse_args()
    device = torch.device(args.device)
    model, batch = build(device, args.seq)
    root = Path(args.offload_dir or tempfile.mkdtemp(prefix="bench-offload-"))
    offloads = {}
    for name, (_, kind, _) in CONFIGS.items():
        if kind == "naive":
            offloads[name] = naive_offload(model, root / "naive")
            (root / "naive").mkdir(parents=True, exist_ok=True)
        elif kind is not None:
            offloads[name] = ActivationOffload(model, kind, MIN_SIZE, offload_dir=root / "disk")
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    peaks: dict[str, float] = dict.fromkeys(CONFIGS, 0.0)
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (checkpointing, _, chunked) in CONFIGS.items():
            with Peak(device) as peak:
                start = time.perf_counter()
                one_step(model, batch, checkpointing, offloads.get(name), chunked)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
            if round_:
                times[name].append(elapsed)
                peaks[name] = max(peaks[name], peak.mib)
    moved = {name: off.stats["offloaded_bytes"] / (args.rounds + 1) / 2**20 for name, off in offloads.items()}
    for off in offloads.values():
        off.close()

    tokens = batch["input_ids"].numel()
    speed = {name: tokens / min(t) for name, t in times.items()}
    print(f"# PYTHONPATH=. python benchmarks/offload.py --device {args.device} --seq {args.seq} --rounds {args.rounds}")
    print(f"# {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__},"
          f" {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; LoRA r=16 on Llama hidden 256 x 4 layers,"
          f" vocab 32000, micro-batch 1 x {args.seq} tokens, offload_min_size {MIN_SIZE >> 10} KiB")
    print("# tokens/s: best of the rounds; peak MiB: above the memory live before the step")
    print(f"{'configuration':<28}{'tokens/s':>10}{'vs ckpt':>9}{'peak MiB':>10}{'vs ckpt':>9}{'offloaded MiB':>15}")
    for name in CONFIGS:
        reference = "no ckpt" if name.startswith("no ckpt") else "ckpt"
        print(f"{name:<28}{speed[name]:>10.0f}{speed[name] / speed[reference]:>8.2f}x"
              f"{peaks[name]:>10.1f}{peaks[name] / peaks[reference]:>8.2f}x{moved.get(name, 0):>15.1f}")
    ok = True
    for mode in ("ckpt", "no ckpt"):
        ours, naive = speed[f"{mode} + disk offload"], speed[f"{mode} + naive sync disk"]
        line = f"{mode}: disk tier {ours / naive:.2f}x the tokens/s of naive synchronous disk offload"
        if mode == "no ckpt":  # with checkpointing so few bytes move that both costs are within the noise
            ok &= ours > naive
            line += " -- OK" if ours > naive else " -- FAIL"
        print(line)
    if device.type == "cuda":
        for name, floor in (("ckpt + cpu offload", 0.95), ("ckpt + disk offload", 0.85)):
            ratio = speed[name] / speed["ckpt"]
            ok &= ratio >= floor
            print(f"{name}: {ratio:.3f}x checkpointing alone (target >= {floor}) -- {'OK' if ratio >= floor else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
