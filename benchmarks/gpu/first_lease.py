"""The first lease: one call of at most 540 s on a CUDA machine lent for 15 minutes of device time in all,
bringing back the table that decides whether the planner's promise holds on CUDA.

The rows (ROWS), in the order of what they decide per second of device time:

1. the environment check: the packages the kit imports are the versions it carried, the GPU, a bitsandbytes
   4-bit forward and backward on the device, the allocator APIs (seconds; nothing else means anything without it);
2. planner vs CUDA peak across the settings that matter, on Qwen2.5-0.5B (loads in seconds): QLoRA, LoRA bf16,
   full fine-tuning with 8-bit and paged AdamW, chunked loss, tiled MLP, offload cpu and disk, micro-batch > 1,
   accumulation; then GRPO (generation and training planned together) on the same small model;
3. Llama-3.1-8B, loaded ONCE (random weights, 4-bit) and lent to every row after it, each planned anew: QLoRA
   at 2k and 8k, tokens/s of `finetune run` vs HF Trainer + PEFT, max context at 8 GiB in at most 3 probes.
   The small-model rows come first because a row measured while the 8B weights sit on the GPU would count
   them in its peak;
4. the mixture-of-experts row (the smallest MoE fixture config, after the 8B model is released; skipped,
   saying so, in a build whose fixtures hold no MoE config).

Each row is saved as it ends, with its own seconds and the estimate below beside them, so the next lease's
plan is sized from measurements. A row starts only if its estimate, scaled by how the rows so far compared with
theirs, ends before --time-limit. The time model is checked on the CPU (`run.sh --cpu --first-lease` prints
it): a plan whose estimate exceeds WORK_LIMIT_S is refused before anything runs.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import platform
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.gpu import configs
from benchmarks.gpu.memory import empty_host_cache
from finetune.compat import LOCK, tested_versions

if TYPE_CHECKING:
    pass

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parents[1] / "tests" / "fixtures" / "configs"

# --- the time model: H100 (SXM, 80 GB) rates, each a stated assumption the rows' measured seconds correct ---
H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak, FLOP/s
UTILIZATION = {"bf16": 0.30, "4bit": 0.20}  # of that peak in 3-step runs; 4-bit dequantizes before each matmul
HBM_BYTES_S = 3.35e12  # weights read by forward, recompute and backward
HOST_LINK_BYTES_S = 20e9  # PCIe 5 x16, pinned: offload cpu moves each checkpoint out and back
DISK_BYTES_S = 2e9  # NVMe: offload disk writes and reads each checkpoint; a full fine-tune's saved weights
LOAD_FIXED_S = 4.0  # a model load's imports, meta model, tokenizer
LOAD_BYTES_S = 0.5e9  # random weights: bf16 bytes drawn on the GPU, copied to the host, loaded (quantized) back
RUN_OVERHEAD_S = 6.0  # per `finetune run`: plan (meta trace), data, run folder, first-step warm-up, adapter save
STEP_OVERHEAD_S = 0.3  # per optimizer step: kernel launches, the loop, logging
DECODE_S_PER_LAYER_TOKEN = 1e-3  # GRPO generation: HF generate is launch-bound, per decoder layer and new token
ENV_S = 30.0  # wheels install (about 20 s on a bare machine), imports, the environment check
PROBE_SEQ = 8192  # max context at 8 GiB: the length each probe is priced at (Unsloth's 2,972 x ~3)
PREDICT_MAX_S = 16.0  # the planner's own search for the longest fitting length: about 8 plans of ~2 s on the host
WORK_LIMIT_S = 420.0  # a 540-s call less a 60-s margin for the last row and 60 s of start-up around the suite
SPEED_STEPS, PROBES, BUDGET_GB = 8, 3, 8

MOE_ROW = "MoE QLoRA 2k"
MOE_SKIP = "no MoE family support in this build"
LARGE = configs.LLAMA


@dataclass(frozen=True)
class Row:
    """One row of the first lease: `kind` says how it runs (env, load, train, moe, speed, max_context)."""

    name: str
    stage: str  # the results stage it lands in (results.STAGES)
    kind: str
    cfg: dict = field(default_factory=dict)  # a configs._cfg dict (model, seq, mb, acc, keys)


def _by_name() -> dict[str, dict]:
    return {c["name"]: c for c in configs.stage_a() + configs.stage_c_speed()}


def rows() -> list[Row]:
    """The first lease's rows, in order (module docstring)."""
    cfgs = _by_name()
    small = [c["name"] for c in configs.small_model_sweep()] + [
        "Qwen2.5-0.5B full adamw_8bit", "Qwen2.5-0.5B full paged_adamw_8bit", "Qwen2.5-0.5B LoRA mb4 acc2",
        configs.GRPO_ROW]
    moe = moe_model()
    return [
        Row("environment", "env", "env"),
        *[Row(name, "a", "train", cfgs[name]) for name in small],
        Row("load Llama-3.1-8B 4-bit (random weights, once for the rows after it)", "env", "load", cfgs["Llama-3.1-8B QLoRA 2k"]),
        Row("Llama-3.1-8B QLoRA 2k", "a", "train", cfgs["Llama-3.1-8B QLoRA 2k"]),
        Row("Llama-3.1-8B QLoRA 8k", "a", "train", cfgs["Llama-3.1-8B QLoRA 8k"]),
        Row("Llama-3.1-8B QLoRA 2k mb1", "c", "speed", cfgs["Llama-3.1-8B QLoRA 2k mb1"]),
        Row(f"{BUDGET_GB} GB", "b", "max_context",
            {"name": "b", "model": LARGE, "seq": PROBE_SEQ, "mb": 1, "acc": 1, "keys": configs.STAGE_B_RECIPE}),
        Row(MOE_ROW, "a", "moe", {**cfgs["Llama-3.1-8B QLoRA 2k"], "name": MOE_ROW, "model": moe} if moe else {}),
    ]


def moe_model() -> str | None:
    """The smallest mixture-of-experts fixture config (tests/fixtures/configs), None while there is none."""
    found = [(_params(c)[0], p.stem) for p in FIXTURES.glob("*.json") if _experts(c := _config(p.stem))]
    return min(found)[1] if found else None


# --- estimates ---------------------------------------------------------------------------------------------
def _config(model: str) -> dict:
    return json.loads((FIXTURES / f"{model}.json").read_text())


def _experts(c: dict) -> int:
    return int(c.get("num_local_experts") or c.get("num_experts") or 0)


def _params(c: dict) -> tuple[float, float]:
    """(all parameters, those one token's forward multiplies by, the LM head included) from a config.json."""
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads") or heads
    attn = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    experts = _experts(c)
    mlp_one = 3 * h * (c.get("moe_intermediate_size") or c["intermediate_size"])
    mlp_all = mlp_one * max(experts, 1)
    mlp_active = mlp_one * (c.get("num_experts_per_tok") or 1) if experts else mlp_one
    embed = vocab * h
    total = layers * (attn + mlp_all) + embed * (1 if c.get("tie_word_embeddings") else 2)
    return total, layers * (attn + mlp_active) + embed


def load_seconds(model: str) -> float:
    """Loading `model` with random weights: the bf16 bytes drawn, copied to the host and loaded back."""
    return LOAD_FIXED_S + 2 * _params(_config(model))[0] / LOAD_BYTES_S


def step_seconds(cfg: dict, seq: int | None = None) -> float:
    """One optimizer step: FLOPs (forward, checkpoint recompute, backward: 6 x active parameters per token with
    a frozen base, 8 for a full fine-tune; attention's seq^2 term on top) at the utilized H100 rate, or the
    weights read three times from HBM if slower; plus what offload moves over its link and a fixed overhead."""
    c = _config(cfg["model"])
    keys = cfg["keys"]
    seq = seq or cfg["seq"]
    total, active = _params(c)
    tokens = seq * cfg["mb"] * cfg["acc"]
    per_token = 8 if keys.get("adapter.type") == "full" else 6
    heads = c["num_attention_heads"]
    attn_width = (c.get("head_dim") or c["hidden_size"] // heads) * heads
    flops = per_token * active * tokens + 8 * c["num_hidden_layers"] * seq * seq * attn_width * cfg["mb"] * cfg["acc"]
    four_bit = keys.get("quantization.bits") == 4
    compute = flops / (H100_BF16_FLOPS * UTILIZATION["4bit" if four_bit else "bf16"])
    weights = total * (0.5 if four_bit else 2.0)
    seconds = max(compute, 3 * weights * cfg["acc"] / HBM_BYTES_S) + STEP_OVERHEAD_S
    offload = keys.get("memory.offload")
    if offload in ("cpu", "disk", "auto"):  # each layer's checkpointed input out and back, bf16
        moved = 2 * tokens * c["hidden_size"] * 2 * c["num_hidden_layers"]
        seconds += moved / (DISK_BYTES_S if offload == "disk" else HOST_LINK_BYTES_S)
    if keys.get("memory.tiled_mlp") in (True, "auto"):  # one more MLP forward per layer: ~1/6 of the step
        seconds += compute / 6
    return seconds


def estimate(row: Row) -> float:
    """The row's estimated GPU seconds on an H100 (the rates above)."""
    cfg = row.cfg
    if row.kind == "env":
        return ENV_S
    if row.kind == "load":
        return load_seconds(cfg["model"])
    if row.kind == "moe" and not cfg:
        return 0.0
    if row.kind == "speed":  # finetune run, then HF Trainer + PEFT, each SPEED_STEPS steps
        return 2 * (RUN_OVERHEAD_S + SPEED_STEPS * step_seconds(cfg))
    if row.kind == "max_context":  # PROBES probes of 2 steps at about PROBE_SEQ tokens
        return PREDICT_MAX_S + PROBES * (RUN_OVERHEAD_S + 2 * step_seconds(cfg))
    seconds = RUN_OVERHEAD_S + 3 * step_seconds(cfg)
    if cfg["model"] != LARGE:  # every row outside the lent group loads its own model
        seconds += load_seconds(cfg["model"])
    if cfg["keys"].get("adapter.type") == "full":  # the run saves every weight
        seconds += 2 * _params(_config(cfg["model"]))[0] / DISK_BYTES_S
    if cfg.get("prompts"):  # GRPO: each step generates the completions first
        completion = cfg["keys"]["grpo.max_completion_length"]
        seconds += 3 * completion * _config(cfg["model"])["num_hidden_layers"] * DECODE_S_PER_LAYER_TOKEN
    return seconds


class PlanRefused(Exception):
    """The plan's estimate exceeds the work a 540-s call can hold; its text is one line (the suite exits 2)."""


def check_plan(plan: list[Row], limit: float = WORK_LIMIT_S) -> list[tuple[Row, float]]:
    """Each row with its estimate; PlanRefused when their sum exceeds `limit` seconds."""
    priced = [(row, estimate(row)) for row in plan]
    total = sum(seconds for _, seconds in priced)
    if total > limit:
        slowest = max(priced, key=lambda p: p[1])
        raise PlanRefused(f"first lease refused: the rows' estimated {total:.0f} s of H100 work exceed {limit:.0f} s "
                          f"(the slowest, {slowest[0].name!r}, {slowest[1]:.0f} s); drop rows from "
                          f"benchmarks/gpu/first_lease.py rows() or leave them to a later call")
    return priced


def plan_table(priced: list[tuple[Row, float]], limit: float = WORK_LIMIT_S) -> str:
    """The planned order with each row's estimate, as the dry run prints it."""
    total = sum(seconds for _, seconds in priced)
    lines = [f"first lease: {len(priced)} rows, estimated {total:.0f} s of H100 work (limit {limit:.0f} s; "
             "rates in benchmarks/gpu/first_lease.py)", f"{'#':>3} {'est s':>6}  stage  row"]
    lines += [f"{i:>3} {seconds:>6.1f}  {row.stage:5s}  {row.name}" for i, (row, seconds) in enumerate(priced, 1)]
    return "\n".join(lines)


# --- running it ----------------------------------------------------------------------------------------------
# --- the environment check -----------------------------------------------------------------------------------
def carried_pins(script: Path = HERE / "wheels.sh", lock: Path = LOCK) -> dict[str, str]:
    """The packages wheels.sh carries to the GPU machine (its CARRIED block), at the lock's versions."""
    text = script.read_text()
    block = text[text.index("CARRIED=("):text.index("\n)", text.index("CARRIED=("))]  # comments may hold ")"
    names = re.findall(r"^\s*([A-Za-z0-9_.\- ]+?)\s*(?:#.*)?$", block.split("(", 1)[1], re.M)
    pins = tested_versions(lock)
    return {name: pins.get(_norm(name), "not in the lock") for line in names for name in line.split()}


def cuda_extra() -> set[str]:
    """The packages of the project's cuda extra (Liger Kernel), by normalized name: carried, needed on CUDA only."""
    from packaging.requirements import Requirement

    out = set()
    for text in md.requires("finetune") or []:
        req = Requirement(text)
        if req.marker is not None and req.marker.evaluate({"extra": "cuda"}) and not req.marker.evaluate({"extra": ""}):
            out.add(_norm(req.name))
    return out


def image_packages(listing: Path = HERE / "image_packages.txt") -> dict[str, str]:
    """The GPU image's packages (normalized names) with the version the listing gives ("" where it gives none)."""
    out = {}
    for line in listing.read_text().splitlines():
        if not line.startswith("#"):
            out.update((_norm(w.partition("==")[0]), w.partition("==")[2]) for w in line.split())
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_differences(pins: dict[str, str]) -> list[str]:
    """The image's listed versions (not carried) that differ from what is installed here: recorded, not fatal
    (the kit runs on the image's torch and accelerate as they are; a new image shows here)."""
    out = []
    for name, listed in pins.items():
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            continue
        if listed and installed.split("+")[0] != listed:
            out.append(f"{name} {installed} (listed {listed})")
    return out


def version_problems(pins: dict[str, str]) -> list[str]:
    """One line per carried package that Python would not import at its carried version: another version
    first on the path, or a module loaded from outside the distribution that has the carried version."""
    modules: dict[str, list[str]] = {}
    for top, dists in md.packages_distributions().items():
        for dist in dists:
            modules.setdefault(_norm(dist), []).append(top)
    problems = []
    for dist, wanted in pins.items():
        try:
            found = md.distribution(dist)
        except md.PackageNotFoundError:
            problems.append(f"{dist}: not importable; the kit carried {wanted}")
            continue
        root = Path(str(found.locate_file(""))).resolve()
        if found.version != wanted:
            problems.append(f"{dist} {found.version} (in {root}) would be imported; the kit carried {wanted}")
            continue
        for top in modules.get(_norm(dist), []):
            module = sys.modules.get(top)
            origin = getattr(module, "__file__", None) if module else None
            spec = importlib.util.find_spec(top) if origin is None and top.isidentifier() else None
            origin = origin or (spec.origin if spec is not None else None)
            if origin and origin not in ("built-in", "frozen") and not Path(origin).resolve().is_relative_to(root):
                problems.append(f"{dist}: `import {top}` loads {origin}, not the carried {wanted} in {root}")
    return problems


def environment_row(versions: dict[str, str], pins: dict[str, str] | None = None) -> dict[str, Any]:
    """What the machine has, and whether what the suite relies on works there; status ok or error. `pins`
    (default: what wheels.sh carries) are checked first: a package at another version fails the row."""
    started = time.time()
    checks: dict[str, str] = {}
    cuda = torch.cuda.is_available()
    row: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "versions": versions,
                           "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    if cuda:
        row["total_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    pins = carried_pins() if pins is None else pins
    if not cuda:  # the CPU dry run: the cuda extra (Liger) runs on CUDA only and is not installed here
        pins = {name: v for name, v in pins.items() if _norm(name) not in cuda_extra()}
    problems = version_problems(pins)
    checks["carried versions"] = f"error: {'; '.join(problems)}" if problems else f"ok ({len(pins)} packages)"
    image = {k: v for k, v in image_packages().items() if k not in {_norm(p) for p in pins}}
    differs = image_differences(image)
    checks["image versions"] = f"differ: {', '.join(differs)}" if differs else "as listed"
    checks["disk /tmp free GiB"] = f"{shutil.disk_usage('/tmp').free / 2**30:.0f}"
    for name, check in (("bitsandbytes 4-bit", _bnb_4bit), ("per-process memory fraction", _fraction),
                        ("pinned host cache", _host_cache)):
        try:
            checks[name] = check(cuda)
        except Exception as exc:  # noqa: BLE001 - each check reports its own failure
            checks[name] = f"error: {type(exc).__name__}: {exc}"[:300]
    row["checks"] = checks
    failed = [k for k, v in checks.items() if v.startswith("error")]
    row["status"] = f"error: {', '.join(failed)}" if failed else "ok"
    row["error_kind"] = "error" if failed else None
    row["seconds"] = round(time.time() - started, 1)
    return row


def _bnb_4bit(cuda: bool) -> str:
    """A 4-bit quantized linear layer's forward and backward on the device (the QLoRA path)."""
    import bitsandbytes as bnb

    device = "cuda" if cuda else "cpu"
    layer = bnb.nn.Linear4bit(256, 256, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4").to(device)
    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().square().sum().backward()
    if x.grad is None or not torch.isfinite(x.grad).all():
        raise RuntimeError("no finite input gradient through the 4-bit layer")
    return f"ok on {device}"


def _fraction(cuda: bool) -> str:
    """torch.cuda.get_per_process_memory_fraction: finetune's OOM recovery reads the stage-b cap with it."""
    if not cuda:
        return "no CUDA"
    return f"ok ({torch.cuda.get_per_process_memory_fraction():.2f})"


def _host_cache(cuda: bool) -> str:
    """The pinned host cache can be emptied between probes (suite.release)."""
    if not cuda:
        return "no CUDA"
    pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    del pinned
    empty_host_cache()
    return "ok"
