"""The GPU suite: every GPU claim measured through the real `finetune run` path, stage by stage.

    python -m benchmarks.gpu.suite OUT_DIR [--cpu] [--stage env,a,b,c,d | --first-lease] [--time-limit 540]

Models: the tests/fixtures/configs/*.json at full size (--cpu: shrunk to toy width and 2 layers) with random
weights (model.path random:FOLDER, quantized on load as the recipe says); data: synthetic text truncated to
exactly max_seq_len tokens. OUT_DIR/results.json and results.md are rewritten after every configuration; a
second call with the same OUT_DIR skips what is already there (a row that failed with an error other than
out-of-memory is tried once more), so the suite can be split across calls. --first-lease runs only the
decisive rows, in their order (benchmarks/gpu/first_lease.py).

Each row records how it ended: status completed, "oom recovered" (the run finished only after finetune's
out-of-memory recovery switched to a cheaper plan: a plan failure, judged on the plan the run started
with), oom or error; with error_kind, the error's text and every out-of-memory event of the run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.gpu import configs, first_lease
from benchmarks.gpu.memory import release
from benchmarks.gpu.results import Results
from finetune.recipe.schema import Recipe
from finetune.rundir import RunDir

if TYPE_CHECKING:
    from finetune.model.load import LoadedModel

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "configs"
REAL_SAMPLE = Path(__file__).resolve().parent / "data" / "alpaca_sample.json"
CUDA = torch.cuda.is_available()
SHRINK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16}
CPU_SEQ_DIVISOR = 32
# --cpu: budgets for stage b, in bytes, standing for the GPU sizes (the toy model's memory is in MiB).
CPU_BUDGETS = {8: 6 << 20}
CPU_KEYS = {"memory.offload_min_size": 1024, "memory.tiled_mlp_tokens": 32, "memory.gpu_memory_margin": 0}
ATTEMPTS = 2  # a row that failed with an error other than out-of-memory is tried again once, in a later call


class TimeUp(Exception):
    """The next probe would end after --time-limit: stop here, a later call goes on."""


class Suite:
    def __init__(self, out: Path, cpu: bool, time_limit: float, work: Path, started_at: float | None = None):
        self.cpu, self.time_limit, self.work = cpu, time_limit, work
        self.start = started_at or time.time()  # run.sh passes its own start: the wheels' install counts
        self.longest = 0.0  # the slowest training run so far: no new one starts unless it would still fit
        self.results = Results(out, _header(cpu))
        self.call = {"started": self.results.data["started"], "device": self.results.data["device"], "seconds": 0.0,
                     "rows": 0}
        self.results.data["calls"].append(self.call)
        self.attempts: dict[tuple[str, str], int] = {}
        self.results.save()

    # --- building blocks -------------------------------------------------------------------------------
    def time_left(self, runs: int = 1) -> bool:
        """Whether `runs` more training runs as slow as the slowest so far end before --time-limit."""
        return time.time() - self.start + runs * self.longest < self.time_limit

    def put(self, stage: str, row: dict[str, Any]) -> None:
        """Save a row (with its attempt number) and this call's device time so far."""
        row["attempts"] = self.attempts.get((stage, row["name"]), 1)
        self.call.update(seconds=round(time.time() - self.start, 1), rows=self.call["rows"] + (row["status"] != "partial"))
        self.results.put(stage, row)

    def model_dir(self, name: str) -> Path:
        """A random:FOLDER model: the fixture's config.json (shrunk with --cpu) and the toy tokenizer."""
        folder = self.work / "models" / name
        if not (folder / "config.json").is_file():
            from finetune.testing import make_tokenizer

            tokenizer = make_tokenizer()
            config = json.loads((FIXTURES / f"{name}.json").read_text())
            if self.cpu:
                config.update(SHRINK, vocab_size=len(tokenizer), max_position_embeddings=1 << 16, bos_token_id=None,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
                config.pop("layer_types", None)
            folder.mkdir(parents=True)
            (folder / "config.json").write_text(json.dumps(config))
            tokenizer.save_pretrained(folder)
        return folder

    def seq(self, cfg: dict) -> int:
        """max_seq_len: the configuration's, divided by CPU_SEQ_DIVISOR on toy models (real data: as is)."""
        return max(16, cfg["seq"] // CPU_SEQ_DIVISOR) if self.cpu and not cfg.get("real") else cfg["seq"]

    def text_data(self, seq: int, records: int) -> Path:
        """JSONL text records of seq+16 words each: at least one token per word, so every record is cut to
        exactly max_seq_len tokens."""
        path = self.work / "data" / f"text-{seq}-{records}.jsonl"
        if not path.is_file():
            words = "the quick brown fox jumps over lazy dog memory model answer question capital".split()
            rng = random.Random(seq)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as f:
                for _ in range(records):
                    f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(seq + 16))}) + "\n")
        return path

    def real_data(self, records: int) -> Path:
        """One micro-batch of real alpaca records, trained again every step: the sample's longest record (cut to
        max_seq_len) and the `records - 1` shortest (under it), so that each step's batch is padded at
        max_seq_len with its attention mask, the batch the plan prices, and the steps after the first carry the
        optimizer's state too. Not the whole sample: there most records reach max_seq_len under the toy
        tokenizer (the same on every device), so its longest batches hold two cut rows and are never padded
        (no mask, K/V not copied: 10% under the plan), and its padded batches are shorter. Chosen by text
        length; the row's data stats show exactly one record cut."""
        path = self.work / "data" / f"alpaca-{records}.json"
        if not path.is_file():
            sample = sorted(json.loads(REAL_SAMPLE.read_text()), key=lambda r: sum(len(str(v)) for v in r.values()))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(sample[-1:] + sample[:records - 1]))
        return path

    def completion(self, cfg: dict) -> int:
        """A GRPO row's completion tokens (shrunk with the sequence on --cpu)."""
        return max(8, cfg["keys"]["grpo.max_completion_length"] // (CPU_SEQ_DIVISOR if self.cpu else 1))

    def prompt_data(self, cfg: dict, records: int = 64) -> Path:
        """Prompt-only JSONL for a GRPO row: each prompt the toy tokenizer's text cut to 12 tokens less than the
        row's prompt length (the chat template adds its own; a longer prompt would be dropped), with an answer."""
        from transformers import AutoTokenizer

        prompt_tokens = self.seq(cfg) - self.completion(cfg)
        path = self.work / "data" / f"prompts-{prompt_tokens}.jsonl"
        if not path.is_file():
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir(cfg["model"]))
            rng = random.Random(prompt_tokens)
            words = "what is the sum of two and three answer briefly please".split()
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as f:
                for i in range(records):
                    ids = tokenizer(" ".join(rng.choice(words) for _ in range(prompt_tokens)))["input_ids"]
                    prompt = tokenizer.decode(ids[:max(2, prompt_tokens - 12)])
                    f.write(json.dumps({"prompt": prompt, "answer": str(i)}) + "\n")
        return path

    def recipe(self, cfg: dict, steps: int, run_dir: Path, **more: Any) -> Recipe:
        seq = self.seq(cfg)
        records = cfg["mb"] * cfg["acc"] * steps
        data: dict[str, dict[str, Any]] = {
            "model": {"path": f"random:{self.model_dir(cfg['model'])}"},
            "data": {"path": str(self.text_data(seq, records)), "format": "text", "max_seq_len": seq},
            "training": {"max_steps": steps, "micro_batch_size": cfg["mb"], "gradient_accumulation_steps": cfg["acc"],
                         "logging_steps": 1, "warmup_ratio": 0.0},
            "memory": {"activation_checkpointing": True}, "adapter": {}, "quantization": {}, "optimizer": {},
            "output": {"dir": str(run_dir), "save_steps": 10_000}, "grpo": {}}
        grpo = {"grpo.max_completion_length": self.completion(cfg)} if cfg.get("prompts") else {}
        for key, value in {**cfg["keys"], **(CPU_KEYS if self.cpu else {}), **grpo, **more}.items():
            section, name = key.split(".")
            data[section][name] = value
        return Recipe.model_validate(data)

    def train(self, recipe: Recipe, memory_cap: int | None = None, base: LoadedModel | None = None) -> dict[str, Any]:
        """`finetune run` (finetune.api.run) on the recipe; the plan it made, the measured peaks, tokens/s.

        memory_cap: on CUDA, torch.cuda.set_per_process_memory_fraction so that the allocator plus what the
        CUDA context holds outside it stays within memory_cap bytes, as on a GPU of that size (finetune's
        out-of-memory recovery then budgets within the cap too). base: a model loaded once
        (finetune.api.load_base) that the run trains on and hands back; the measured peak includes its
        weights, as the plan does.
        """
        from finetune.api import run

        release()
        if CUDA and memory_cap:
            total = torch.cuda.get_device_properties(0).total_memory
            free, _ = torch.cuda.mem_get_info()
            outside = total - free - torch.cuda.memory_reserved()  # context, cuBLAS workspace, other processes
            torch.cuda.set_per_process_memory_fraction(max(memory_cap - outside, 1) / total)
        out: dict[str, Any] = {"status": "completed"}
        if CUDA:  # what earlier configurations left allocated (should stay ~0: a leak would inflate every peak)
            out["allocated_before_bytes"] = int(torch.cuda.memory_allocated())
        started = time.time()
        try:
            result = run(recipe, overwrite=True, base=base)
            out["status"] = result.state
        except Exception as exc:  # one broken configuration must not stop the suite: it is reported
            out.update(error_record(exc))
        finally:
            if CUDA:
                torch.cuda.synchronize()
                out["measured_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
                out["measured_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
                torch.cuda.set_per_process_memory_fraction(1.0)
            release()
        out["seconds"] = round(time.time() - started, 1)
        run_dir = RunDir(Path(recipe.output.dir))
        metrics = run_dir.read_metrics()
        events = [{k: r[k] for k in ("event", "oom_step", "error", "from", "to", "gpu_memory_bytes") if k in r}
                  for r in metrics if str(r.get("event", "")).startswith("oom")]
        plan = run_dir.read_plan()
        if events:  # plan.json and the peak statistics now follow the recovered settings; the row judges the
            out.update(oom_events=events, error_kind="oom")  # plan the run started with, which did not fit
            out["status"] = "oom recovered" if out["status"] == "completed" else out["status"]
        if events or plan is None:  # None: a run that ended before its first step removed its folder with it
            plan = _initial_plan(recipe)
        if plan is not None:
            out.update(predicted_bytes=plan["peak_bytes"], fits=plan["fits"], settings=plan["settings"],
                       predicted_tokens_per_s=plan.get("tokens_per_s"))  # GRPO: generation and scoring included
            if plan.get("generation_bytes"):  # GRPO: both phases' predictions
                out.update(predicted_generation_bytes=plan["generation_bytes"],
                           predicted_training_bytes=plan["training_bytes"])
        rates = [m["tokens_per_second"] for m in metrics if "tokens_per_second" in m]
        from benchmarks.gpu.baselines import steady_tokens_per_s

        out["tokens_per_s"] = steady_tokens_per_s(rates)  # GRPO: prompts and completions per second of the step
        for phase in ("generation", "training"):  # GRPO: each phase's own rate
            rates = [m[f"{phase}_tokens_per_second"] for m in metrics if f"{phase}_tokens_per_second" in m]
            if rates:
                out[f"{phase}_tokens_per_s"] = steady_tokens_per_s(rates)
        if not CUDA and metrics and out["status"] == "completed":  # the CPU tensor tracker's peak
            out["measured_allocated_bytes"] = max(m.get("peak_memory_bytes") or 0 for m in metrics)
        results = run_dir.read_results()
        if results is not None:
            out["data"] = results.get("data")
        shutil.rmtree(run_dir.root, ignore_errors=True)
        self.longest = max(self.longest, out["seconds"])
        return out

    def start_attempt(self, stage: str, name: str) -> None:
        """The row about to be measured counts one more attempt than the saved one (a partial row continues)."""
        row = self.results.row(stage, name)
        previous = 0 if row is None else row.get("attempts", 1) - (row["status"] == "partial")
        self.attempts[(stage, name)] = previous + 1

    def each(self, stage: str, names: list[str], subset: bool = False, runs=lambda name: 1):
        """Yield the names not measured yet (or failed with an error, not an OOM, fewer than ATTEMPTS times)
        while `runs(name)` more training runs fit in the time left; set the stage's status."""
        self.results.set_stage(stage, "running")
        for name in names:
            row = self.results.row(stage, name)
            if row is not None and not again(row):
                continue
            if not self.time_left(runs(name)):
                self.results.set_stage(stage, "partial: time limit reached, call again with the same OUT_DIR")
                return
            self.start_attempt(stage, name)
            yield name
        self.results.set_stage(stage, "done: the --first-lease rows" if subset else "done")

    # --- stages ----------------------------------------------------------------------------------------
    def stage_a(self, only: list[str] | None = None) -> None:
        cfgs = configs.stage_a_cpu() if self.cpu else configs.stage_a()
        cfgs = cfgs + [{"name": "Qwen2.5-0.5B QLoRA real data (alpaca sample)", "model": configs.QWEN05, "seq": 256,
                        "mb": 2, "acc": 1, "keys": {**configs.QLORA, **configs.PLAIN}, "real": True}]
        by_name = {c["name"]: c for c in cfgs}
        for name in self.each("a", _pick(by_name, only), only is not None):
            self.put("a", self.row_a(by_name[name]))
        self.summarize_a()

    def row_a(self, cfg: dict, base: LoadedModel | None = None) -> dict[str, Any]:
        """One planner-vs-measured row: 3 steps of `finetune run`, the prediction's error against the peaks."""
        more = {"data.path": str(self.real_data(cfg["mb"])), "data.format": "auto"} if cfg.get("real") else \
            {"data.path": str(self.prompt_data(cfg))} if cfg.get("prompts") else {}
        row = {"name": cfg["name"], "max_seq_len": self.seq(cfg),
               **self.train(self.recipe(cfg, 3, self.work / "run", **more), base=base)}
        for kind in ("reserved", "allocated"):
            measured = row.get(f"measured_{kind}_bytes")
            if measured and row.get("predicted_bytes") and row["status"] == "completed":
                row[f"error_{kind}"] = row["predicted_bytes"] / measured - 1
        return row

    def summarize_a(self) -> None:
        self.results.set_stage("a", self.results.data["stages"]["a"]["status"], _summary_a(self.results))

    def stage_b(self, budgets: list[int], subset: bool = False) -> None:
        names = {f"{gb} GB": gb for gb in budgets}
        for name in self.each("b", list(names), subset):
            try:
                self.put("b", {"name": name, "status": "done", **self.max_context(name, names[name])})
            except TimeUp:
                self.results.set_stage("b", "partial: time limit reached, call again with the same OUT_DIR")
                break
        rows = [r for r in self.results.data["stages"]["b"]["rows"] if r.get("status") == "done"]
        self.results.set_stage("b", self.results.data["stages"]["b"]["status"], {
            "goal: trained >= 1.5x Unsloth at every size": len(rows) == len(budgets)
            and all(r["vs_unsloth"] >= 1.5 for r in rows),
            "note": "--cpu: toy model, budgets in MiB; the Unsloth ratio means nothing there" if self.cpu else ""})

    def max_context(self, name: str, gb: int, base: LoadedModel | None = None,
                    max_probes: int | None = None) -> dict[str, Any]:
        """The planner's longest fitting sequence, and the longest that really trains 2 steps within the budget
        (the planner's settings for that length; CUDA capped to the budget, CPU: tracked peak <= budget).
        `base`: the probes train on this loaded model; `max_probes`: the search ends after that many training
        probes with the longest that trained (then a lower bound). Raises TimeUp when a probe would not fit.

        Every probe is saved as it ends (a partial row), and a later call reuses those probes."""
        from finetune.plan import predict

        cfg = {"name": "b", "model": configs.LLAMA, "seq": 0, "mb": 1, "acc": 1, "keys": configs.STAGE_B_RECIPE}
        positions = json.loads((FIXTURES / f"{configs.LLAMA}.json").read_text())["max_position_embeddings"]
        step, cap = (64, 1024) if self.cpu else (1024, min(1 << 18, positions))  # no probe beyond the model
        budget = CPU_BUDGETS[gb] if self.cpu else gb << 30
        started = time.time()
        old = self.results.row("b", name) or {}
        # A probe: "ok" (2 steps trained within the budget), "oom", "oom recovered" (trained only after a
        # cheaper plan than the planner's: fails the length), "over budget" (CPU) or "error" (text in errors).
        probes = {int(k): v for k, v in (old.get("probes") or {}).items() if v != "error"}  # errors: again
        errors = dict(old.get("errors") or {})

        def planned(seq: int):
            r = self.recipe({**cfg, "seq": seq * (CPU_SEQ_DIVISOR if self.cpu else 1)}, 2, self.work / "run",
                            **{"memory.gpu_memory": budget})
            return predict(r, device="cuda" if CUDA else "cpu"), r

        def trains(seq: int) -> bool:
            if seq not in probes and not self.time_left():
                raise TimeUp
            if seq not in probes:
                plan, r = planned(seq)
                out = self.train(plan.apply(r).recipe, memory_cap=budget if CUDA else None, base=base)
                over = not CUDA and out.get("measured_allocated_bytes", 0) > budget
                probes[seq] = "over budget" if out["status"] == "completed" and over else \
                    "ok" if out["status"] == "completed" else out["status"]
                if out.get("error") or out.get("oom_events"):
                    errors[str(seq)] = out.get("error") or out["oom_events"][0].get("error")
                self.put("b", {"name": name, "status": "partial", "predicted_max_tokens": predicted,
                               "probes": dict(sorted(probes.items())), "errors": errors})
            return probes[seq] == "ok"

        predicted = _search(lambda seq: planned(seq)[0].fits, step, cap)
        trained = _search(trains, step, cap, start=predicted or step, max_probes=max_probes)
        theirs = configs.UNSLOTH_MAX_CONTEXT[gb]
        failed = "error" in probes.values()  # then a later call probes those lengths again (ATTEMPTS)
        return {"error_kind": "error" if failed else None, "budget_bytes": budget, "unsloth_tokens": theirs, "predicted_max_tokens": predicted,
                "trained_max_tokens": trained, "vs_unsloth": trained / theirs, "probes": dict(sorted(probes.items())),
                "errors": errors, "max_probes": max_probes,
                "seconds": round(time.time() - started + old.get("seconds", 0), 1)}

    def stage_c(self, only: list[str] | None = None) -> None:
        steps = 3 if self.cpu else 8
        speed = configs.stage_c_speed()[:1] if self.cpu else configs.stage_c_speed()
        overheads = configs.stage_c_overheads((8192,) if self.cpu else (8192, 32768))
        variants = [] if self.cpu else configs.stage_c_variants()  # Liger needs CUDA; CPU: benchmarks/compile.py
        cfgs = {c["name"]: c for c in speed + overheads + variants}
        for name in self.each("c", _pick(cfgs, only), only is not None, lambda n: 3 if cfgs[n] in speed else 1):
            cfg = cfgs[name]
            if cfg in speed:
                row = self.speed_row(cfg, steps, ("hf_peft", "trl"))
            else:  # against its reference row: its length's checkpointing alone, or the variant's own
                row = self.speed_row(cfg, steps * (3 if cfg in variants else 1), ())
                reference = self.results.row("c", cfg.get("reference") or f"{name.split()[0]} checkpointing alone")
                if reference and reference.get("finetune_tokens_per_s") and row["finetune_tokens_per_s"]:
                    row["overhead"] = 1 - row["finetune_tokens_per_s"] / reference["finetune_tokens_per_s"]
            self.put("c", row)
        rows = self.results.data["stages"]["c"]["rows"]
        ratios = [r[k] for r in rows for k in ("vs_hf_peft", "vs_trl") if r.get(k)]
        over = {kind: max((r["overhead"] for r in rows if kind in r["name"] and "overhead" in r), default=None)
                for kind in ("offload cpu", "offload disk", "tiled MLP", "chunked loss")}
        self.results.set_stage("c", self.results.data["stages"]["c"]["status"], {
            "lowest speed ratio vs HF/TRL (goal >= 1.0x)": min(ratios) if ratios else None,
            **{f"worst overhead {k}": v for k, v in over.items()},
            **{f"speed vs reference, {label}": [round(1 - r["overhead"], 3) for r in rows
                                                if r["name"].endswith(f"k {label}") or r["name"].endswith(f"mb4 {label}")
                                                if "overhead" in r] or None
               for label in (*configs.KERNEL_VARIANTS, *configs.STREAM_VARIANTS)
               if label not in ("kernels none", "weights resident")},
            "goal: offload cpu <= 5%, disk <= 15%": None if over["offload cpu"] is None else
            bool(over["offload cpu"] <= 0.05 and (over["offload disk"] or 0) <= 0.15)})

    def speed_row(self, cfg: dict, steps: int, frameworks: tuple[str, ...],
                  base: LoadedModel | None = None) -> dict[str, Any]:
        """Tokens/s of `finetune run` and of each baseline framework at the identical configuration, on `base`
        (one loaded model for all) when given."""
        from benchmarks.gpu.baselines import baseline_tokens_per_s

        row: dict[str, Any] = {"name": cfg["name"], "max_seq_len": self.seq(cfg)}
        ours = self.train(self.recipe(cfg, steps, self.work / "run"), base=base)
        row.update({k: ours[k] for k in ("status", "error_kind", "error", "oom_events", "predicted_bytes",
                                         "measured_reserved_bytes", "predicted_tokens_per_s") if k in ours},
                   finetune_tokens_per_s=ours["tokens_per_s"], seconds=ours["seconds"])
        for framework in frameworks:
            started = time.time()
            release()
            try:
                theirs = baseline_tokens_per_s(self.recipe(cfg, steps, self.work / framework), framework,
                                               self.work / framework, base=base)
            except Exception as exc:  # reported in the table, the suite goes on
                theirs, row[f"{framework}_error"] = None, error_record(exc)
            release()
            row[f"{framework}_tokens_per_s"] = theirs
            if theirs and ours["tokens_per_s"]:
                row[f"vs_{framework}"] = ours["tokens_per_s"] / theirs
            row["seconds"] = round(row["seconds"] + time.time() - started, 1)
            self.longest = max(self.longest, time.time() - started)
            shutil.rmtree(self.work / framework, ignore_errors=True)
        return row

    def stage_env(self) -> None:
        """Every call (each may be a fresh machine), whatever the time: it takes seconds."""
        row = {"name": "environment", **first_lease.environment_row(self.results.data["versions"])}
        self.put("env", row)
        self.results.set_stage("env", "done")
        if row["checks"]["carried versions"].startswith("error"):  # nothing measured after this would mean much
            raise SystemExit(f"environment check failed: {row['checks']['carried versions'].removeprefix('error: ')}")

    def stage_d(self) -> None:
        import importlib.util

        if importlib.util.find_spec("unsloth") is None:
            self.put("d", {"name": "Unsloth max context at 16 GB and tokens/s at the stage-c configuration",
                           "status": "not run: unsloth wheels absent (benchmarks/gpu/wheels.sh --unsloth)"})
            self.results.set_stage("d", "not run: wheels absent")
            return
        self.put("d", {"name": "Unsloth max context at 16 GB and tokens/s at the stage-c configuration",
                       "status": "not run: unsloth is importable but the side-by-side runner is not "
                                 "written yet (it needs a weights folder; see docs/gpu.md)"})
        self.results.set_stage("d", "not run: runner missing")


class _Enough(Exception):
    """max_probes reached: the search ends with the largest length known to pass."""


def _search(ok, step: int, cap: int, start: int | None = None, max_probes: int | None = None) -> int:
    """Largest multiple of `step` in [step, cap] with ok(x), ok being true up to some point; 0 if none.

    Without `start`, plain bisection. From `start` (a prediction) it brackets by steps of 10% up or down, then bisects: few probes when the
    prediction is close, each of which may be a real training run. `max_probes`: at most that many calls of
    ok, the answer then the largest length known to pass (a lower bound).
    """
    def snap(x: float) -> int:
        return min(cap, max(step, int(x) // step * step))

    calls = 0

    def probe(x: int) -> bool:
        nonlocal calls
        if max_probes is not None and calls >= max_probes:
            raise _Enough
        calls += 1
        return ok(x)

    lo, hi = 0, cap + step  # lo: largest known to pass (0: none yet), hi: smallest known to fail
    try:
        x = snap(start or step)
        if start is None:  # no prediction to start from: plain bisection
            pass
        elif probe(x):
            lo = x
            while lo < cap:
                x = snap(lo * 1.1 + step)
                if not probe(x):
                    hi = x
                    break
                lo = x
        else:
            hi = x
            while lo == 0:
                x = snap(hi * 0.9)
                if x >= hi:
                    return 0
                if probe(x):
                    lo = x
                else:
                    hi = x
        while hi - lo > max(step, lo // 16):  # within ~6% (or one step): a bounded number of probes
            mid = snap((lo + hi) // 2)
            if mid <= lo or mid >= hi:
                break
            lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    except _Enough:
        pass
    return lo


def _summary_a(results: Results) -> dict[str, Any]:
    rows = results.data["stages"]["a"]["rows"]
    errors = [abs(r["error_reserved"]) for r in rows if r.get("error_reserved") is not None] or \
        [abs(r["error_allocated"]) for r in rows if r.get("error_allocated") is not None]
    fits_but_failed = [f"{r['name']} ({r['status']})" for r in rows if r.get("fits") and r["status"] != "completed"]
    return {"configurations": len(rows), "completed": sum(r["status"] == "completed" for r in rows),
            "median |error|": statistics.median(errors) if errors else None,
            "max |error|": max(errors) if errors else None,
            "within 7%": sum(e <= 0.07 for e in errors),
            "plans that fit but OOMed or failed": ", ".join(fits_but_failed) or "none",
            "error measured against": "max_memory_reserved" if CUDA else "CPU tensor tracker (no allocator)"}


def error_record(exc: BaseException) -> dict[str, str]:
    """How a run failed: status and error_kind "oom" (CUDA's out-of-memory, or finetune's error after its
    recovery gave up) or "error" (anything else: a bug on the CUDA path must not read as a short context),
    and the error's text."""
    text = f"{type(exc).__name__}: {exc}".strip()
    oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
    kind = "oom" if oom else "error"
    return {"status": kind, "error_kind": kind, "error": text[:600]}


def again(row: dict[str, Any]) -> bool:
    """Whether a saved row is measured again: stage b's unfinished search, or an error (not an OOM) that
    has had fewer than ATTEMPTS tries."""
    return row["status"] == "partial" or (row.get("error_kind") == "error" and row.get("attempts", 1) < ATTEMPTS)


def _pick(by_name: dict[str, Any], only: list[str] | None) -> list[str]:
    """The names to run: all, or `only` in its order (each must be a configuration of the stage)."""
    if only is None:
        return list(by_name)
    unknown = [n for n in only if n not in by_name]
    if unknown:
        raise SystemExit(f"no such configuration: {', '.join(unknown)}")
    return list(only)


def _initial_plan(recipe: Recipe) -> dict[str, Any] | None:
    """The plan `finetune run` starts from (what plan.json held before an out-of-memory re-plan)."""
    from finetune.plan import predict

    try:
        return predict(recipe).to_dict()
    except Exception:  # noqa: BLE001 - a model the planner cannot trace: the row has no prediction
        return None


# --- the first lease's rows (benchmarks/gpu/first_lease.py prices them), run in order ----------------------


def run_first_lease(suite: Suite, priced: list[tuple[first_lease.Row, float]]) -> None:
    """Print the plan (check_plan's), then run each row not measured yet, in order, while its estimate (scaled
    by measured/estimated so far) still ends before the suite's time limit. The environment check runs every
    call (each may be a fresh machine) and stops the call when a carried package is not what is imported."""
    print(first_lease.plan_table(priced), flush=True)
    suite.results.data["first_lease_plan"] = [{"name": r.name, "stage": r.stage, "estimated_s": round(s, 1)}
                                              for r, s in priced]
    pace = Pace()
    base: LoadedModel | None = None
    try:
        for i, (row, seconds) in enumerate(priced):
            if row.kind == "env":
                suite.stage_env()
                continue
            pending = [r for r, _ in priced[i:] if r.kind != "load" and _pending(suite, r)]
            if row.kind == "load" and not pending:  # every row that needs the model is measured
                break
            if not pending or pending[0] is not row and row.kind != "load":
                continue
            if not pace.fits(suite, seconds):
                _stop(suite, priced[i:], pending)
                return
            if base is not None and row.cfg.get("model") != first_lease.LARGE:  # its peak must not count the 8B weights
                base = None
                release()
            suite.start_attempt(row.stage, row.name)
            started = time.time()
            try:
                base, out = _load(suite, row) if row.kind == "load" else (base, _run_row(suite, row, base))
            except TimeUp:  # a max-context probe would end too late: the probes so far are saved
                _stop(suite, priced[i:], pending)
                return
            suite.put(row.stage, {**out, "estimated_s": round(seconds, 1)})
            pace.add(seconds, time.time() - started)
    finally:
        base = None
        suite.summarize_a()
    for stage in ("a", "b", "c"):
        suite.results.set_stage(stage, "done: the --first-lease rows")
    print("first lease: every row measured; no second call needed", flush=True)


def _stop(suite: Suite, rest: list[tuple[first_lease.Row, float]], pending: list[first_lease.Row]) -> None:
    """Out of time: the stages with rows left are partial, and the log says what a second call would take."""
    for stage in {r.stage for r in pending}:
        suite.results.set_stage(stage, "partial: time limit reached, call again with the same OUT_DIR")
    left = sum(s for r, s in rest if r in pending or r.kind == "load")
    print(f"first lease: {len(pending)} rows left, estimated {left:.0f} s: a second call with "
          f"--time-limit of at least {left + 60:.0f} s measures them", flush=True)


def _pending(suite: Suite, row: first_lease.Row) -> bool:
    """Whether the row is still to measure: not saved yet, or saved with a result measured again (suite.again)."""
    done = suite.results.row(row.stage, row.name)
    return done is None or again(done)


class Pace:
    """How the rows so far compared with their estimates: a row starts only if estimate x ratio still ends in
    time (ratio 1 until a row has run)."""

    def __init__(self) -> None:
        self.estimated = self.measured = 0.0

    def add(self, estimated: float, measured: float) -> None:
        self.estimated += estimated
        self.measured += measured

    def fits(self, suite: Suite, estimated: float) -> bool:
        ratio = self.measured / self.estimated if self.estimated else 1.0
        return time.time() - suite.start + estimated * ratio < suite.time_limit


def _load(suite: Suite, row: first_lease.Row) -> tuple[LoadedModel | None, dict[str, Any]]:
    """The 8B model loaded once (finetune.api.load_base), the row its seconds and what it holds on the device."""
    from finetune.api import load_base

    release()
    recipe = suite.recipe(row.cfg, 3, suite.work / "run")
    started = time.time()
    out: dict[str, Any] = {"name": row.name, "status": "ok"}
    base = None
    try:
        base = load_base(recipe)
        if torch.cuda.is_available():
            out["allocated_bytes"] = int(torch.cuda.memory_allocated())
    except Exception as exc:  # the rows after it then load nothing and report the error
        out.update(error_record(exc))
    out["seconds"] = round(time.time() - started, 1)
    return base, out


def _run_row(suite: Suite, row: first_lease.Row, base: LoadedModel | None) -> dict[str, Any]:
    """One row of kind train, moe, speed or max_context, with its own seconds."""
    started = time.time()
    lent = base if row.cfg.get("model") == first_lease.LARGE else None
    if row.kind == "moe" and not row.cfg:
        out: dict[str, Any] = {"name": row.name, "status": f"skipped: {first_lease.MOE_SKIP}"}
    elif row.cfg.get("model") == first_lease.LARGE and base is None:
        out = {"name": row.name, "status": "error", "error_kind": "error",
               "error": f"{first_lease.LARGE} did not load (see its row in env)"}
    elif row.kind == "speed":
        out = suite.speed_row(row.cfg, 3 if suite.cpu else first_lease.SPEED_STEPS, ("hf_peft",), base=lent)
    elif row.kind == "max_context":
        out = {"name": row.name, "status": "done", **suite.max_context(row.name, first_lease.BUDGET_GB, lent, first_lease.PROBES)}
    else:
        out = suite.row_a(row.cfg, base=lent)
    return {**out, "seconds": round(time.time() - started, 1)}


def _header(cpu: bool) -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets", "unsloth"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = "absent"
    device = torch.cuda.get_device_name(0) if CUDA else "CPU dry run (toy models)" if cpu else "CPU"
    return {"device": device, "command": " ".join(["python -m benchmarks.gpu.suite", *sys.argv[1:]]),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "versions": versions,
            "cpu_dry_run": cpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cpu", action="store_true", help="tiny configurations on the CPU (the kit's own test)")
    parser.add_argument("--stage", default="env,a,b,c,d", help="comma-separated stages to run (env,a,b,c,d)")
    parser.add_argument("--first-lease", action="store_true",
                        help="only the decisive rows, in order (benchmarks/gpu/first_lease.py); call again to go on")
    parser.add_argument("--started-at", type=float, help="epoch seconds the call began (run.sh passes its start)")
    parser.add_argument("--budgets", default="8,12,16,24", help="stage b: GPU sizes in GB")
    parser.add_argument("--time-limit", type=float, default=540,
                        help="seconds; no configuration starts that would end after this (the device allows 600)")
    parser.add_argument("--work-limit", type=float, default=None,
                        help="--first-lease: refuse a plan whose estimated H100 seconds exceed this (default 420)")
    args = parser.parse_args(argv)
    if not CUDA and not args.cpu:
        parser.error("no CUDA GPU here: pass --cpu for the dry run")
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.cpu:
        budgets = [b for b in budgets if b in CPU_BUDGETS] or list(CPU_BUDGETS)
    priced = None
    if args.first_lease:  # refused before anything runs or is written
        try:
            priced = first_lease.check_plan(first_lease.rows(), args.work_limit or first_lease.WORK_LIMIT_S)
        except first_lease.PlanRefused as exc:
            print(exc, file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="finetune-gpu-suite-"))
    try:
        suite = Suite(args.out, args.cpu, args.time_limit, work, args.started_at)
        if priced is not None:
            run_first_lease(suite, priced)
        for stage in [] if args.first_lease else args.stage.split(","):
            {"env": suite.stage_env, "a": suite.stage_a, "b": lambda: suite.stage_b(budgets), "c": suite.stage_c,
             "d": suite.stage_d}[stage]()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"results: {args.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
