"""Planning time of a 7-9B model with every planned key on auto: cold (empty trace cache), warm (a new
process with the cache on disk) and hot (the same process planning again, as the UI does), side by side.

Each cold and warm run is a fresh Python process with its own FINETUNE_CACHE; the time is `predict()` alone
(imports are listed apart), wall clock and, in brackets, the process's CPU time (on a machine shared with
other jobs the CPU time is the steadier number). Budget 24 GiB on a planned CUDA device, effective batch 16.
The offload bandwidths are measured once per machine (`finetune.memory.bandwidth`, not part of the trace
cache): a first plan measures them, and every cold cache starts with that measurement.

    python benchmarks/plan_speed.py > benchmarks/results/plan_speed.txt
    python benchmarks/plan_speed.py --compare REF   # also the same runs with finetune as of git REF, interleaved
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
CASES = [("llama-3.1-8b.json", 4096), ("qwen2.5-7b.json", 4096), ("llama-3.1-8b.json", 32768),
         ("llama-3.1-8b.json", 131072)]


def recipe(config: str, seq: int):
    from finetune.recipe.schema import Recipe

    auto = "auto"
    return Recipe.model_validate({
        "model": {"path": str(CONFIGS / config)}, "data": {"path": "unused", "max_seq_len": seq},
        "quantization": {"bits": auto}, "optimizer": {"name": auto},
        "training": {"micro_batch_size": auto, "gradient_accumulation_steps": auto, "effective_batch_size": 16},
        "memory": {"activation_checkpointing": auto, "offload": auto, "chunked_loss": auto, "tiled_mlp": auto}})


def child(config: str, seq: int) -> None:
    """One process: import, plan, plan again; print the timings as JSON."""
    start = time.perf_counter()
    from finetune.plan import predict

    imported = time.perf_counter()
    r = recipe(config, seq)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = predict(r, gpu_memory="24GiB", device="cuda")
    t1, c1 = time.perf_counter(), time.process_time()
    predict(r, gpu_memory="24GiB", device="cuda")
    t2 = time.perf_counter()
    print(json.dumps({"import": imported - start, "first": t1 - t0, "first_cpu": c1 - c0, "again": t2 - t1,
                      "fits": plan.fits, "settings": plan.settings, "peak": plan.peak_bytes}))


def run(config: str, seq: int, cache: str, root: Path = ROOT) -> dict:
    """`child` in a fresh process, importing finetune from `root`."""
    env = {"FINETUNE_CACHE": cache, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root),
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, __file__, "--child", config, str(seq)], env=env, check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def _export(ref: str, into: Path) -> Path:
    """The tree of git `ref` (no checkout: the repository's worktrees are left alone)."""
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
    into.mkdir()
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _row(label: str, config: str, seq: int, cold: dict, warm: dict) -> str:
    return (f"{label:>9} {config.removesuffix('.json'):>14} {seq:>7} {warm['import']:>7.2f} "
            f"{cold['first']:>6.2f} ({cold['first_cpu']:>5.2f}) {warm['first']:>6.2f} ({warm['first_cpu']:>5.2f}) "
            f"{warm['again']:>6.2f}")


def main(compare: str | None) -> None:
    print(f"# python benchmarks/plan_speed.py{' --compare ' + compare if compare else ''}  (predict() seconds, "
          "wall (CPU); device=cuda planned")
    print("#  on this CPU machine; every planned key auto, 24 GiB budget; cold = empty trace cache, warm = new")
    print("#  process, cache on disk, hot = same process again)")
    with tempfile.TemporaryDirectory(prefix="plan-speed-") as tmp:
        tmp = Path(tmp)
        trees = [("this", ROOT)] + ([(compare[:9], _export(compare, tmp / "ref"))] if compare else [])
        seed = tmp / "seed"
        first = run(*CASES[0], str(seed))
        print(f"# first plan on this machine (measures the offload bandwidths, then cold): {first['first']:.2f} s")
        print(f"{'code':>9} {'model':>14} {'tokens':>7} {'import':>7} {'cold':>14} {'warm':>14} {'hot':>6}")
        for config, seq in CASES:
            answers = []
            for label, root in trees:
                cache = tmp / f"cache-{label}-{config}-{seq}"
                cache.mkdir()
                shutil.copy(seed / "bandwidth.json", cache / "bandwidth.json")
                cold = run(config, seq, str(cache), root)
                warm = run(config, seq, str(cache), root)
                answers.append((cold["settings"], cold["peak"], warm["settings"], warm["peak"]))
                print(_row(label, config, seq, cold, warm))
                sys.stdout.flush()
            plans = {json.dumps(p, sort_keys=True) for a in answers for p in (a[:2], a[2:])}
            print(f"{'':>9} same plan (settings and peak) cold, warm{' and both codes' if compare else ''}: "
                  f"{len(plans) == 1}{'' if len(plans) == 1 else ': '}"
                  f"{'' if len(plans) == 1 else '; '.join(sorted(plans))}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main(sys.argv[sys.argv.index("--compare") + 1] if "--compare" in sys.argv else None)
