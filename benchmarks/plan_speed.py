"""Planning time of a 7-9B model with every planned key on auto: cold (empty trace cache), warm (a new
process with the cache on disk) and hot (the same process planning again, as the UI does), side by side.

Each cold and warm run is a fresh Python process with its own FINETUNE_CACHE; the time is `predict()` alone
(imports are listed apart). Budget 24 GiB on a planned CUDA device, effective batch 16.

    python benchmarks/plan_speed.py > benchmarks/results/plan_speed.txt
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "configs"
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
    t0 = time.perf_counter()
    plan = predict(r, gpu_memory="24GiB", device="cuda")
    t1 = time.perf_counter()
    predict(r, gpu_memory="24GiB", device="cuda")
    t2 = time.perf_counter()
    print(json.dumps({"import": imported - start, "first": t1 - t0, "again": t2 - t1, "fits": plan.fits}))


def run(config: str, seq: int, cache: str) -> dict:
    env = {"FINETUNE_CACHE": cache, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, __file__, "--child", config, str(seq)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    print("# python benchmarks/plan_speed.py  (predict() seconds; device=cuda planned on this CPU machine;")
    print("#  every planned key auto, 24 GiB budget; cold = empty trace cache, warm = new process, cache on disk,")
    print("#  hot = same process again)")
    print(f"{'model':>20} {'tokens':>7} {'import':>7} {'cold':>7} {'warm':>7} {'hot':>7} {'cold/warm':>10}")
    for config, seq in CASES:
        with tempfile.TemporaryDirectory(prefix="plan-speed-") as cache:
            cold = run(config, seq, cache)
            warm = run(config, seq, cache)
        print(f"{config.removesuffix('.json'):>20} {seq:>7} {warm['import']:>7.2f} {cold['first']:>7.2f} "
              f"{warm['first']:>7.2f} {warm['again']:>7.2f} {cold['first'] / warm['first']:>9.1f}x")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
