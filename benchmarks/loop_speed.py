"""Training-loop speed, side by side in one run: `finetune run` from one or more source trees (the loop before and
after a rewrite) against TRL's SFTTrainer + PEFT LoRA, on the same model, examples and settings (issue #27).

    python benchmarks/loop_speed.py [--tree NAME=PATH ...] [--steps 12] [--repeats 3] [--threads 1]
    python benchmarks/loop_speed.py --tree old=/path/to/old --tree new=$PWD     # after the rewrite
    python benchmarks/loop_speed.py --smoke --model TINY_MODEL_DIR --out FILE   # plumbing only (the test)

Every run is its own subprocess with OMP/MKL threads and torch.set_num_threads set alike (--threads):
  NAME (a --tree; default `current=` this repository)  finetune.api.run of the recipe with PYTHONPATH=PATH
  trl   finetune's own loader (finetune/model/load.py: the .gguf dequantized, 4-bit bitsandbytes) and examples
        (finetune.data.build_datasets: the same input_ids and labels) from this repository, handed to
        trl.SFTTrainer with peft_config=LoraConfig(the recipe's r, alpha, dropout, target_modules) and TRL's
        own collator (the one finetune uses), AdamW (torch), the same schedule, clipping, seed, mixed precision and
        activation checkpointing; no eval, no saving. TRL casts LoRA weights to bf16 on a quantized model; they
        are cast back to adapter.dtype (fp32) so both sides do the same arithmetic.
The recipe (default recipes/quickstart.yaml) runs with its micro-batch, accumulation and max_seq_len, its
`auto` memory keys set to the planner's quickstart choice (chunked_loss, tiled_mlp: false), the noise-scale
probe and memory tracker at their defaults, max_steps = --steps, a checkpoint never (the adapter is saved
after the last step, outside the timing).

Timing: each optimizer step's end is stamped with time.perf_counter() and time.process_time() (this process's
CPU time, which other programs on a shared machine disturb far less than the wall clock): for finetune when its
metrics.jsonl row is written (finetune.rundir.RunDir.append_metrics, logging_steps 1), for TRL at on_step_end.
Time per step = (stamp[steps] - stamp[warmup]) / (steps - warmup): the first --warmup steps are left out. Runs
alternate (A B C A B C ...); the table gives best and median over the repeats, and `x` the median over the
fastest baseline's median (baselines: every variant but --candidate, the last tree by default). Tokens per timed
step (non-padding, as metrics.jsonl's tokens_seen counts them) must agree within 1% across variants, and the
loss of step 1 shows that both start from the same weights and examples.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "loop_speed.txt"
TRL = "trl"
# The quickstart's `auto` memory keys, as its plan resolves them (README: "chose memory.chunked_loss=false,
# memory.tiled_mlp=false automatically"), so no variant runs a planner's choice the other does not.
FIXED_MEMORY = ("memory.chunked_loss=false", "memory.tiled_mlp=false")
NEVER = 2**31 - 1  # output.save_steps: no checkpoint inside the timed steps
TOKEN_TOLERANCE = 0.01


# -- the subprocesses -------------------------------------------------------------------------------------------

def overrides(cfg: dict) -> list[str]:
    """`--set` items that pin everything the variants must share (model, data file, batch, steps, memory)."""
    items = [f"training.max_steps={cfg['steps']}", f"output.dir={cfg['out']}", f"output.save_steps={NEVER}",
             f"data.path={cfg['data']}", f"data.max_seq_len={cfg['max_seq_len']}", *FIXED_MEMORY,
             *(f"training.{k}={cfg[k]}" for k in ("micro_batch_size", "gradient_accumulation_steps"))]
    return items + ([f"model.path={cfg['model']}"] if cfg["model"] else [])


def child_finetune(cfg: dict) -> dict:
    """`finetune run` from the tree on PYTHONPATH; each metrics row stamped as it is written."""
    import finetune
    from finetune import api
    from finetune.recipe.settings import auto_keys
    from finetune.rundir import RunDir

    tree = Path(os.environ["PYTHONPATH"]).resolve()
    if not Path(finetune.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"imported finetune from {finetune.__file__}, not from the tree {tree}")
    recipe = api.load_recipe(cfg["recipe"], overrides(cfg))
    if "data.batching" in auto_keys(recipe):  # a tree that has the key: random order, as TRL's sampler draws
        recipe = api.load_recipe(cfg["recipe"], [*overrides(cfg), "data.batching=random"])
    if auto_keys(recipe):
        raise SystemExit(f"the recipe still has auto keys {auto_keys(recipe)}: give them values with --set")
    stamps: list[dict] = []
    write = RunDir.append_metrics

    def stamped(run, row: dict) -> None:
        write(run, row)
        if "loss" in row:
            stamps.append({"step": row["step"], "wall": time.perf_counter(), "cpu": time.process_time(),
                           "tokens": row.get("tokens_seen"), "loss": row["loss"]})

    RunDir.append_metrics = stamped
    api.run(recipe, overwrite=True)
    return {"stamps": stamps, "source": str(Path(finetune.__file__).parent)}


def child_trl(cfg: dict) -> dict:
    """The same model and examples through trl.SFTTrainer + peft, loaded by this repository's finetune."""
    import torch
    from peft import LoraConfig
    from transformers import TrainerCallback, set_seed
    from trl import SFTConfig, SFTTrainer

    from finetune import api
    from finetune.data import build_datasets
    from finetune.model.load import load_model
    from finetune.step.training_step import mixed_precision
    from finetune.units import torch_dtype

    recipe = api.load_recipe(cfg["recipe"], overrides(cfg))
    t, a = recipe.training, recipe.adapter
    set_seed(t.seed)  # as finetune run: seed, load, adapter (LoRA's random init), then the examples
    model, tokenizer, _ = load_model(recipe.model, recipe.quantization)
    data = build_datasets(recipe.data, tokenizer, t.seed)
    stamps: list[dict] = []
    losses: dict[int, float] = {}

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append({"step": state.global_step, "wall": time.perf_counter(), "cpu": time.process_time(),
                           "tokens": state.num_input_tokens_seen})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

    precision = mixed_precision(recipe.model.dtype, torch.cuda.is_available())  # as finetune's Trainer: none on CPU
    args = SFTConfig(
        output_dir=cfg["out"], max_steps=t.max_steps, per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps, learning_rate=t.learning_rate,
        lr_scheduler_type="cosine", warmup_steps=round(t.warmup_ratio * t.max_steps),
        max_grad_norm=t.max_grad_norm or 0.0, optim="adamw_torch", weight_decay=recipe.optimizer.weight_decay,
        adam_beta1=recipe.optimizer.betas[0], adam_beta2=recipe.optimizer.betas[1], adam_epsilon=recipe.optimizer.eps,
        seed=t.seed, data_seed=t.seed, logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        disable_tqdm=True, activation_checkpointing=bool(recipe.memory.activation_checkpointing),
        activation_checkpointing_kwargs={"use_reentrant": False}, bf16=precision == "bf16",
        fp16=precision == "fp16", use_cpu=not torch.cuda.is_available(), include_num_input_tokens_seen="non_padding",
        max_length=recipe.data.max_seq_len, dataset_kwargs={"skip_prepare_dataset": True}, dataloader_num_workers=0)
    lora = LoraConfig(task_type="CAUSAL_LM", r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout,
                      target_modules=a.target_modules)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data.train, processing_class=tokenizer,
                         peft_config=lora, callbacks=[Stamp()])
    dtype = torch_dtype(a.dtype)
    for p in trainer.model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)
    trainer.train()
    for s in stamps:
        s["loss"] = losses.get(s["step"])
    return {"stamps": stamps, "source": "trl " + version("trl")}


def child(kind: str, cfg_path: str) -> None:
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # benchmarks/ holds scripts whose names could shadow modules
    import torch

    cfg = json.loads(Path(cfg_path).read_text())
    torch.set_num_threads(cfg["threads"])
    result = child_trl(cfg) if kind == TRL else child_finetune(cfg)
    Path(cfg["result"]).write_text(json.dumps(result))


# -- the parent -------------------------------------------------------------------------------------------------

def run_variant(name: str, tree: Path, cfg: dict, scratch: Path) -> dict:
    """One run in a subprocess with PYTHONPATH=tree: its stamps, checked to cover every step."""
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=scratch))
    cfg = {**cfg, "out": str(folder / "out"), "result": str(folder / "result.json")}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    threads = str(cfg["threads"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("FINETUNE_") or k == "FINETUNE_CACHE"}
    env.update(PYTHONPATH=str(tree), OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
               OPENBLAS_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    log = folder / "log.txt"
    with log.open("w") as out:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", TRL if name == TRL else
                               "finetune", str(folder / "cfg.json")], env=env, cwd=folder, stdout=out,
                              stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0 or not Path(cfg["result"]).is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise SystemExit(f"{name}: the run failed (exit {done.returncode}); the end of its output:\n{tail}")
    result = json.loads(Path(cfg["result"]).read_text())
    steps = [s["step"] for s in result["stamps"]]
    if steps != list(range(1, cfg["steps"] + 1)) or any(s["tokens"] is None for s in result["stamps"]):
        raise SystemExit(f"{name}: expected a stamp with tokens_seen for each step 1..{cfg['steps']}, got steps "
                         f"{steps} (finetune: one metrics.jsonl row per step through RunDir.append_metrics)")
    return result


def per_step(result: dict, warmup: int) -> dict:
    """Seconds (wall, CPU) and tokens per step after the warm-up steps; the loss of step 1."""
    first, last = result["stamps"][warmup - 1], result["stamps"][-1]
    n = last["step"] - first["step"]
    return {k: (last[k] - first[k]) / n for k in ("wall", "cpu", "tokens")} | {"loss": result["stamps"][0]["loss"]}


def git_version(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() or "not a git tree"


def parse_tree(item: str) -> tuple[str, Path]:
    name, sep, path = item.partition("=")
    tree = Path(path or ROOT).resolve()
    if not sep or not name or name == TRL or not (tree / "finetune" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"--tree {item}: give NAME=PATH (NAME not '{TRL}'), PATH a folder "
                                         "holding finetune/__init__.py (a checkout of this repository)")
    return name, tree


def recipe_batch(recipe: Path) -> dict:
    """The recipe's micro-batch, accumulation and max_seq_len, which every variant runs with (explicit numbers
    only), and its data file (or each file of a list) as an absolute path (a relative one is relative to this
    repository)."""
    import yaml

    text = yaml.safe_load(recipe.read_text()) or {}
    training, data = text.get("training", {}), text.get("data", {})
    fixed = {k: training.get(k, 1) for k in ("micro_batch_size", "gradient_accumulation_steps")}
    fixed["max_seq_len"] = data.get("max_seq_len")
    if any(not isinstance(v, int) for v in fixed.values()):
        raise SystemExit(f"{recipe}: training.micro_batch_size, gradient_accumulation_steps and data.max_seq_len "
                         f"must be numbers (not auto or missing) for a like-for-like comparison, not {fixed}")
    def absolute(raw: str) -> str:
        path = Path(raw)
        return str(path if path.is_absolute() else (ROOT / path).resolve())

    files = data["path"]
    if isinstance(files, str):
        return fixed | {"data": absolute(files)}
    mixed = [absolute(f) if isinstance(f, str) else {**f, "path": absolute(f["path"])} for f in files]
    return fixed | {"data": json.dumps(mixed)}  # a list of files (a mix) as a --set value: YAML reads JSON


def table(rows: dict[str, list[dict]], candidate: str) -> list[str]:
    """The table: best and median per variant, `x` = median over the fastest baseline's median."""
    med = {name: {k: statistics.median(r[k] for r in runs) for k in ("wall", "cpu", "tokens")}
           for name, runs in rows.items()}
    tokens = {name: m["tokens"] for name, m in med.items()}
    if max(tokens.values()) > (1 + TOKEN_TOLERANCE) * min(tokens.values()):
        raise SystemExit(f"tokens per timed step differ by more than {TOKEN_TOLERANCE:.0%}: {tokens}; the "
                         "variants do not train on the same batches")
    baselines = [name for name in rows if name != candidate]
    fastest = {k: min(baselines, key=lambda n: med[n][k]) for k in ("cpu", "wall")}
    lines = [f"{'variant':>10} {'tokens/step':>11} {'loss@1':>7} {'cpu s/step best':>15} {'median':>7} {'x':>6} "
             f"{'wall s/step best':>16} {'median':>7} {'x':>6}"]
    for name, runs in rows.items():
        ratio = {k: med[name][k] / med[fastest[k]][k] for k in ("cpu", "wall")}
        loss = "-" if runs[0]["loss"] is None else f"{runs[0]['loss']:.4f}"
        lines.append(f"{name:>10} {med[name]['tokens']:>11.1f} {loss:>7} "
                     f"{min(r['cpu'] for r in runs):>15.3f} {med[name]['cpu']:>7.3f} {ratio['cpu']:>6.3f} "
                     f"{min(r['wall'] for r in runs):>16.3f} {med[name]['wall']:>7.3f} {ratio['wall']:>6.3f}")
    cpu = med[candidate]["cpu"] / med[fastest["cpu"]]["cpu"]
    lines.append(f"x: median over the fastest baseline's median (cpu: {fastest['cpu']}, wall: {fastest['wall']}). "
                 f"Candidate {candidate}: {cpu:.3f}x by CPU time, "
                 + ("at least as fast: target met" if cpu <= 1 else f"{cpu - 1:.1%} slower: target not met"))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", type=parse_tree, metavar="NAME=PATH",
                        help="a finetune source tree to time (repeatable; default current=this repository)")
    parser.add_argument("--candidate", help="the variant the others are the baselines of (default: the last tree)")
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "quickstart.yaml")
    parser.add_argument("--model", help="model.path instead of the recipe's (the test: a tiny model folder)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads of every run")
    parser.add_argument("--smoke", action="store_true", help="2 steps (1 warm-up), 1 repeat: checks the plumbing")
    parser.add_argument("--out", type=Path, help=f"the results file (default {RESULTS.relative_to(ROOT)}; "
                                                 "none with --smoke)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.repeats = 2, 1, 1
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps")
    trees = dict(args.tree or [parse_tree("current=")])
    candidate = args.candidate or list(trees)[-1]
    if candidate not in trees:
        parser.error(f"--candidate {candidate}: not one of the trees {', '.join(trees)}")
    variants = {**trees, TRL: ROOT}
    cfg = {"recipe": str(args.recipe.resolve()), "model": args.model, "steps": args.steps, "threads": args.threads,
           **recipe_batch(args.recipe)}
    header = [f"# {shlex.join(['python', *sys.argv])}",
              f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start, niceness {os.nice(0)}; torch "
              f"{version('torch')}, transformers {version('transformers')}, trl {version('trl')}, peft "
              f"{version('peft')}; {args.threads} thread(s) per run",
              *(f"# {name}: {tree} ({git_version(tree)})" for name, tree in trees.items()),
              f"# {args.recipe.name}, model {args.model or 'as the recipe'}, micro-batch {cfg['micro_batch_size']} x "
              f"accumulation {cfg['gradient_accumulation_steps']}, {args.steps} steps, the first {args.warmup} "
              f"left out, {args.repeats} repeat(s), variants alternating", ""]
    print("\n".join(header), flush=True)
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    log = []
    with tempfile.TemporaryDirectory(prefix="loop-speed-") as scratch:
        for repeat in range(args.repeats):
            for name, tree in variants.items():
                load = os.getloadavg()[0]
                rows[name].append(per_step(run_variant(name, tree, cfg, Path(scratch)), args.warmup))
                r = rows[name][-1]
                log.append(f"# repeat {repeat + 1} {name:>10}: cpu {r['cpu']:.3f} s/step, wall {r['wall']:.3f} s/step, "
                           f"{r['tokens']:.1f} tokens/step, load average {load:.2f}")
                print(log[-1], flush=True)
    lines = table(rows, candidate)
    print("\n" + "\n".join(lines))
    out = args.out or (None if args.smoke else RESULTS)
    if out is not None:
        out.write_text("\n".join([*header, *log, "", *lines]) + "\n")
        print(f"written to {out}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
