"""Inputs of the planner's speed and offload memory model: measured bandwidths, CPU compute, bytes moved.

Bandwidths are measured once per disk (filesystem device) and per GPU model, the CPU's matmul throughput
and memory bandwidth once per thread count, and cached as JSON in `$FINETUNE_CACHE/bandwidth.json`
(default `~/.cache/finetune`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from finetune.memory.offload_disk import (
    ACTIVATIONS_PREFIX,
    OffloadFolder,
    read_tensor_file,
    write_tensor_file,
)
from finetune.rundir import atomic_write_text
from finetune.units import cache_dir

PROBE_BYTES = 256 << 20
PROBE_CHUNK = 16 << 20  # written as separate files, like activations
MIN_PROBE_BYTES = 1 << 20  # below this the disk is not measured: the planner prices it at the typical speed
# The CPU compute probe: fp32 matmuls of a layer's width at a small and a large row count (tokens), so the
# planner sees both the peak and how far a small micro-batch falls short of it (plan/cost_model.py).
MATMUL_WIDTH = 1024
MATMUL_TOKENS = (128, 1024)
PROBE_SECONDS = 0.25  # per measurement


def cache_path() -> Path:
    """The JSON cache of measured bandwidths."""
    return cache_dir() / "bandwidth.json"


def _load_cache() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _store_cache(key: str, value: dict) -> None:
    cache = _load_cache()
    cache[key] = value
    try:
        atomic_write_text(cache_path(), json.dumps(cache, indent=2, sort_keys=True))
    except OSError:  # a read-only cache, or one another user owns (a shared Docker volume): measure next time
        pass


def measure_disk(directory: str | Path, nbytes: int = PROBE_BYTES) -> dict[str, float]:
    """Write then read `nbytes` in 16 MiB files under `directory`, fsynced and out of the page cache.

    Returns bytes/s for `write` and `read`; the files are removed whatever happens.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    chunk = torch.randint(0, 256, (min(nbytes, PROBE_CHUNK),), dtype=torch.uint8)
    prefix = OffloadFolder(directory, ACTIVATIONS_PREFIX).prefix  # named as ours: a kill leaves nothing for good
    paths = [directory / f"{prefix}bw-{i}" for i in range(max(1, nbytes // chunk.numel()))]
    try:
        start = time.perf_counter()
        for path in paths:
            write_tensor_file(path, chunk)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):  # so the read below comes from the disk, not the cache
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        write = len(paths) * chunk.numel() / (time.perf_counter() - start)
        start = time.perf_counter()
        for path in paths:
            read_tensor_file(path, chunk)
        read = len(paths) * chunk.numel() / (time.perf_counter() - start)
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    return {"write": write, "read": read}


def measure_host_device(device: torch.device, nbytes: int = PROBE_BYTES) -> dict[str, float]:
    """Pinned host <-> CUDA device copy bandwidth in bytes/s (`d2h`, `h2d`)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        result[name] = 3 * nbytes / (start.elapsed_time(end) / 1000)
    return result


def _rate(work: Callable[[], object], units: float, seconds: float, repeats: int = 5) -> float:
    """`units` per second of `work` with the cores to itself: the best of `repeats` timings of about
    seconds/repeats each, after a warm-up, each timed in this process's CPU time over torch's threads. Other
    programs on a shared machine stretch the wall clock, and a probe timed by it would leave every later plan
    pessimistic (the result is cached); they hardly change the CPU time the work takes."""
    work()
    threads = torch.get_num_threads()
    best = 0.0
    for _ in range(repeats):
        count, start, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds / repeats or count < 1:
            work()
            count += 1
        best = max(best, units * count * threads / max(time.process_time() - cpu, 1e-9))
    return best


def measure_cpu(width: int = MATMUL_WIDTH, tokens: tuple[int, ...] = MATMUL_TOKENS,
                seconds: float = PROBE_SECONDS) -> dict[str, float]:
    """This CPU's fp32 matmul FLOP/s at each row count in `tokens` (`flops@N`) and its memory copy
    bandwidth in bytes/s (`mem_bw`), with torch's current thread count."""
    weight = torch.randn(width, width)
    result = {}
    for rows in tokens:
        x = torch.randn(rows, width)
        result[f"flops@{rows}"] = _rate(lambda x=x: torch.mm(x, weight), 2 * rows * width * width, seconds)
    src = torch.ones(PROBE_CHUNK * 4, dtype=torch.uint8)
    dst = torch.empty_like(src)
    result["mem_bw"] = _rate(lambda: dst.copy_(src), 2 * src.numel(), seconds)  # read + write
    return result


def cpu_compute(refresh: bool = False) -> dict[str, float]:
    """Cached `measure_cpu` for this machine at torch's current number of threads."""
    return _cached(f"cpu:{torch.get_num_threads()} threads", measure_cpu, refresh)


def _cached(key: str, measure: Callable[[], dict[str, float]], refresh: bool) -> dict[str, float]:
    cached = _load_cache().get(key)
    if cached is None or refresh:
        cached = measure()
        _store_cache(key, cached)
    return cached


def probe_bytes(directory: Path) -> int:
    """How much the disk probe writes in `directory`: PROBE_BYTES, or a quarter of the free space where that is
    less (a small or nearly full folder is never filled by the measurement), 0 below MIN_PROBE_BYTES."""
    size = min(PROBE_BYTES, shutil.disk_usage(directory).free // 4) // MIN_PROBE_BYTES * MIN_PROBE_BYTES
    return size if size >= MIN_PROBE_BYTES else 0


_PARTIAL: dict[tuple[str, int], dict[str, float]] = {}  # smaller probes: kept for this process's re-plans only


def disk_bandwidth(directory: str | Path, refresh: bool = False) -> dict[str, float] | None:
    """Cached `measure_disk` for the filesystem holding `directory` (measured on first use); None where it
    cannot be measured (too little free space, a read-only or full disk): the planner then uses the typical
    speed rather than fail. Only a full-size measurement is cached on disk; a smaller one (a nearly full disk)
    is remembered by this process, so the re-plans of one command write the probe once."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        key = f"disk:{os.stat(directory).st_dev}"
        cached = _load_cache().get(key)
        if cached is not None and not refresh:
            return cached
        size = probe_bytes(directory)
        if (key, size) in _PARTIAL and not refresh:
            return _PARTIAL[(key, size)]
        measured = measure_disk(directory, size) if size else None
        if size == PROBE_BYTES:
            _store_cache(key, measured)
        elif measured is not None:
            _PARTIAL[(key, size)] = measured
    except OSError:
        return None
    return measured


def host_device_bandwidth(device: torch.device, refresh: bool = False) -> dict[str, float]:
    """Cached `measure_host_device` for this GPU model."""
    return _cached(f"cuda:{torch.cuda.get_device_name(device)}", lambda: measure_host_device(device), refresh)


def transfer_bandwidth(offload_dir: str | Path, cuda: bool,
                       links: Collection[str] = ("host_device", "disk")) -> dict[str, float]:
    """Bytes/s each offload link in `links` moves at on this machine (slower direction), measured once and
    cached: `disk` for the filesystem that will hold `offload_dir`, `host_device` for pinned host<->GPU copies
    (on a GPU only). The tier table (finetune.recipe.offload_tiers) says which link prices which tier. A disk
    that cannot be measured is left out (cost_model's typical figure prices it)."""
    result = {}
    if "disk" in links:
        try:
            probe = Path(offload_dir).resolve()
            while not probe.exists():  # measure where the folder will be, without creating it
                probe = probe.parent
        except OSError:  # a name the disk refuses: the folder's own check names it
            probe = None
        measured = disk_bandwidth(probe) if probe is not None else None
        if measured is not None:
            result["disk"] = min(measured.values())
    if cuda and "host_device" in links:
        result["host_device"] = min(host_device_bandwidth(torch.device("cuda")).values())
    return result


def offload_bytes_per_step(num_layers: int, hidden_size: int, micro_batch: int, seq_len: int,
                           dtype_bytes: int, min_size: int, checkpoint_every_n_layers: int | None,
                           layer_saved_bytes: int = 0, frozen_embeddings: bool = False) -> int:
    """Bytes `ActivationOffload` moves out (and back) per micro-batch: exactly what its hooks offload.

    Layers 0 .. num_layers-2 are offloaded (the last stays on the device). A checkpointed layer (index
    divisible by `checkpoint_every_n_layers`; None = no checkpointing) offloads its input hidden states,
    micro_batch * seq_len * hidden_size * dtype_bytes, when that is >= min_size -- except layer 0 when the
    embeddings are frozen (LoRA/QLoRA): its input is then a leaf that autograd keeps anyway, so it stays.
    Any other layer offloads `layer_saved_bytes`: the sum over the distinct storages one layer saves for
    backward that are each >= min_size (parameters and leaves excluded). The disk tier writes and reads
    these bytes; the cpu tier with offload_cpu_limit sends what exceeds the limit to disk.
    """
    layer_input = micro_batch * seq_len * hidden_size * dtype_bytes
    total = 0
    for index in range(num_layers - 1):
        if checkpoint_every_n_layers is not None and index % checkpoint_every_n_layers == 0:
            offloaded = layer_input >= min_size and not (index == 0 and frozen_embeddings)
            total += layer_input if offloaded else 0
        else:
            total += layer_saved_bytes
    return total
