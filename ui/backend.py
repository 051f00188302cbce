"""What each button and timer of the UI does, as plain functions over the recipe, the run queue and run dirs.

Kept free of layout so the same logic serves the page, the Gradio API and the tests; anything heavy
(training, export) runs in a separate process through the same CLI a user would type, and chat models live
in the chat worker process (ui.chat_worker).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from finetune import api
from finetune.api import RunView
from finetune.errors import FinetuneError, RecipeError
from finetune.recipe.load import (
    MAX_FILE_BYTES,
    load_recipe,
    load_recipe_text,
    recipe_to_yaml,
    reward_files_from,
    validate_recipe,
)
from finetune.recipe.schema import Recipe
from finetune.recipe.settings import auto_choices
from finetune.rundir import RECIPE, HeldRun, RunDir, find_runs
from ui import form
from ui.chat_worker import ChatWorker
from ui.downloads import Downloads
from ui.paths import RECIPE_SUFFIXES, allowed_path, check_data_paths, check_recipe_paths, uploaded_file
from ui.runs import RunManager

CARDS = {"8 GB card (RTX 4060)": 8, "12 GB card (RTX 3060)": 12, "16 GB card (RTX 4080)": 16,
         "24 GB card (RTX 4090)": 24, "48 GB card (RTX 6000 Ada)": 48, "80 GB card (H100)": 80}
THIS_MACHINE = "this machine"  # the GPU choice that plans for the device a run here trains on
CACHED = 16  # GPU-size sweeps and seen-length plans kept per UI process


def default_recipes_dir() -> Path:
    """The ready recipes: ./recipes when the UI runs in a checkout, else the repository's."""
    here = Path.cwd() / "recipes"
    return here if here.is_dir() else Path(__file__).resolve().parents[1] / "recipes"


@dataclass
class UISettings:
    """Where the UI may read and write, and where runs go."""

    allow_dirs: list[Path] = field(default_factory=lambda: [Path.cwd()])
    runs_dir: Path = Path("runs")
    recipes_dir: Path = field(default_factory=default_recipes_dir)
    allow_python_rewards: bool = False  # run recipes whose GRPO rewards are the user's Python (code on this server)

    def __post_init__(self) -> None:
        self.allow_dirs = [Path(p).expanduser().resolve() for p in self.allow_dirs]
        self.runs_dir = Path(self.runs_dir).expanduser().resolve()
        self.recipes_dir = Path(self.recipes_dir).expanduser().resolve()

    @property
    def roots(self) -> list[Path]:
        """Folders the page may point at: the allowed ones and the runs folder."""
        return [*self.allow_dirs, self.runs_dir]


class Backend:
    """The UI's behaviour, bound to one runs folder and set of allowed folders."""

    def __init__(self, settings: UISettings, manager: RunManager):
        self.settings = settings
        self.manager = manager
        self.specs = form.form_specs()
        self.downloads = Downloads()
        self.chat_worker = ChatWorker(manager)
        self._sweeps: dict[str, dict[str, Any]] = {}  # recipe JSON -> api.plan_gpu_sizes
        self._seen: dict[tuple[str, Any, Any], dict[str, Any] | None] = {}  # (run, longest, plan) -> plan there

    # -- recipe --------------------------------------------------------------------------------------
    def recipe(self, values: list[Any]) -> Recipe:
        """The form as a validated recipe; RecipeError lists one problem per bad key."""
        try:
            data = form.values_to_dict(self.specs, list(values))
        except (TypeError, ValueError) as exc:
            raise RecipeError("the form has a value of the wrong type", [str(exc)]) from None
        return validate_recipe(data, "form")

    def load_yaml(self, text: str, source: str) -> list[Any]:
        """A recipe YAML's values for the form (every key, defaults filled in)."""
        recipe = load_recipe_text(text, source)
        return form.dict_to_values(self.specs, recipe.model_dump(mode="python"))

    def load_upload(self, uploaded: str) -> tuple[str, list[Any]]:
        """(file name, form values) of a recipe YAML uploaded through the page (never a server path)."""
        path = uploaded_file(uploaded, RECIPE_SUFFIXES, "recipe YAML")
        if path.stat().st_size > MAX_FILE_BYTES:  # refused before it is read into memory
            raise RecipeError(f"{path.name} is {path.stat().st_size:,} bytes: a recipe is at most {MAX_FILE_BYTES:,}")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RecipeError(f"{path.name} is not a text file (byte {exc.start} is not UTF-8)",
                              hint="save the recipe as UTF-8 text") from None
        return path.name, self.load_yaml(text, path.name)

    def model_choices(self) -> list[tuple[str, str]]:
        """(label, model.path) of the models this machine has (finetune.api.local_models): folders and .gguf
        files inside the allowed folders and the runs folder only, packaged models, the hub cache's by hub id."""
        return [(m["label"], m["path"]) for m in api.local_models(self.settings.roots)]

    def gallery(self) -> list[dict[str, str]]:
        """The ready recipes (name, path, title, description)."""
        return api.recipe_gallery(self.settings.recipes_dir)

    def load_gallery(self, path: str) -> tuple[str, list[Any]]:
        """(title, form values) of a ready recipe; its run goes to the runs folder under the recipe's name."""
        chosen = {r["path"]: r for r in self.gallery()}.get(path)
        if chosen is None:
            raise FinetuneError("pick one of the ready recipes first")
        return chosen["title"], self._with_new_run_dir(load_recipe(path), chosen["name"])

    def load_run_recipe(self, run_dir: str | None) -> tuple[str, list[Any]]:
        """(run, form values) of a previous run's resolved recipe, with a fresh output.dir for the new run."""
        path = self.run_path(run_dir)
        recipe = RunDir(path).recipe
        if not recipe.is_file():
            raise FinetuneError(f"{path} has no {RECIPE} yet", hint="pick a run that has started")
        return str(path), self._with_new_run_dir(load_recipe(recipe), path.name)  # a damaged file: one line

    def _with_new_run_dir(self, recipe: Recipe, name: str) -> list[Any]:
        n, target = 1, self.settings.runs_dir / name
        while target.exists():
            n += 1
            target = self.settings.runs_dir / f"{name}-{n}"
        recipe.output.dir = str(target)
        return form.dict_to_values(self.specs, recipe.model_dump(mode="python"))

    def goal_updates(self, goal: str) -> dict[int, Any]:
        """Widget index -> value for the keys a goal sets (finetune/recipe/goals.py)."""
        from finetune.recipe.goals import goal_values

        keys = [s.key for s in self.specs]
        return {keys.index(k): form.to_widget(self.specs[keys.index(k)], v) for k, v in goal_values(goal).items()}

    def recipe_text(self, values: list[Any]) -> str:
        """The form as recipe YAML, as `finetune run` reads it."""
        return recipe_to_yaml(self.recipe(values))

    def recipe_file(self, values: list[Any], session: str | None) -> Path:
        """Write the form as a recipe YAML to download into the page session's own folder, so no session is
        handed another's recipe (without a session: a fresh folder); it goes when the page closes."""
        path = self.downloads.folder(session) / RECIPE
        path.write_text(self.recipe_text(values), encoding="utf-8")
        return path

    def checked_recipe(self, values: list[Any]) -> Recipe:
        """The form's recipe, refused if any of its paths leads outside the allowed folders; a kind python
        reward's file, relative to the server's working directory (a form has no folder), made absolute so the
        queued run finds it."""
        recipe = reward_files_from(self.recipe(values), Path.cwd())
        check_recipe_paths(recipe, self.settings.roots)
        return recipe

    # -- memory --------------------------------------------------------------------------------------
    @cached_property
    def machine(self) -> dict[str, Any] | None:
        """This machine's device (finetune.api.this_machine); None when it cannot be read."""
        try:
            return api.this_machine()
        except Exception:  # noqa: BLE001 - a broken CUDA install must not stop the UI
            return None

    def gpu_choices(self) -> list[str]:
        """"This machine" first (its GPU, or its CPU where there is none: a run here trains there), then
        common cards."""
        here = self.machine
        mine = [f"{THIS_MACHINE}: {here['name']} ({here['memory_bytes'] / 2**30:.0f} GiB)"] if here else []
        return mine + list(CARDS)

    def gpu_gb(self, gpu: str) -> int | None:
        """The memory size (GiB) of a GPU choice: a common card, or this machine's GPU (None for a CPU)."""
        if gpu in CARDS:
            return CARDS[gpu]
        found = re.search(r"\((\d+) GiB\)$", gpu or "")
        return int(found.group(1)) if found and self.machine and self.machine["device"] == "cuda" else None

    def plan(self, values: list[Any], gpu: str) -> dict[str, Any]:
        """The planner's JSON for the form's recipe on the chosen GPU (a card's size when memory is auto), with
        `speed` (in the plan and each option): the estimate as a person should read it (api.speed_estimate);
        `chosen_automatically`: the recipe's `auto` keys with the values the plan gives them; `planned_for`: what
        the peak is for (the data's largest micro-batch); `fix_lines`: where nothing fits, the fixed settings that
        would fit if left to the planner."""
        recipe = self.checked_recipe(values)
        if (gpu or "").startswith(THIS_MACHINE) and self.machine:  # its device, with the recipe's budget
            planned = api.plan(recipe, device=self.machine["device"])
        else:  # a budget written in the recipe wins; a card's size also tells the planner to plan for a GPU
            card = CARDS[gpu] * 2**30 if gpu in CARDS and recipe.memory.gpu_memory == "auto" else None
            planned = api.plan(recipe, gpu_memory=card)
        plan = json.loads(planned.to_json())
        for option in (plan.get("alternatives") or []) + (plan.get("rejected") or []):
            option["speed"] = api.speed_estimate({**option, **{k: plan.get(k) for k in (
                "device", "device_figures", "figures_measured")}})
        return {**plan, "speed": api.speed_estimate(plan),
                "chosen_automatically": auto_choices(recipe, plan.get("settings") or {}),
                "planned_for": planned.planned_for(), "fix_lines": planned.fix_lines()}

    def gpu_sweep(self, values: list[Any]) -> dict[str, Any]:
        """What fits on each common GPU size (finetune.api.plan_gpu_sizes), kept for the same recipe."""
        recipe = self.checked_recipe(values)
        key = recipe.model_dump_json(exclude={"output"})
        if key not in self._sweeps:
            if len(self._sweeps) >= CACHED:
                self._sweeps.pop(next(iter(self._sweeps)))
            self._sweeps[key] = api.plan_gpu_sizes(recipe)
        return self._sweeps[key]

    def seen_length_plan(self, run: Path | RunView) -> dict[str, Any] | None:
        """The run's plan at the longest sequence it has (finetune.api.plan_at_seen_length), computed once
        per run, length and plan; None when there is nothing to explain or the planner cannot say."""
        files = api.view_of(run)
        key = (str(files.root), files.status.get("longest_sequence_tokens"), (files.plan or {}).get("peak_bytes"))
        if key[1] is None:
            return None
        if key not in self._seen:
            if len(self._seen) >= CACHED:
                self._seen.pop(next(iter(self._seen)))
            try:
                self._seen[key] = api.plan_at_seen_length(files)
            except Exception:  # noqa: BLE001 - a model the planner cannot trace: the view goes without it
                self._seen[key] = None
        return self._seen[key]

    # -- data ----------------------------------------------------------------------------------------
    def preview(self, values: list[Any], n: int = 3) -> tuple[list[dict[str, Any]], list[str]]:
        """The first n examples as the model sees them (dicts with `tokens`: (text, carries loss) pairs,
        `format`, `where`), and the records the reader could not parse (as the CLI reports them)."""
        recipe = self.checked_recipe(values)
        check_data_paths(recipe, self.settings.roots, must_exist=True)
        return api.preview_data(recipe, n)

    # -- training ------------------------------------------------------------------------------------
    def start(self, values: list[Any]) -> Path:
        """Queue a new run of the form's recipe; returns its run directory."""
        recipe = self.checked_recipe(values)
        self.refuse_user_code(recipe)
        run_dir = allowed_path(recipe.output.dir, self.settings.roots, "output.dir")
        RunDir(run_dir).refuse_if_locked("start a run")
        api.preflight(recipe)  # a missing or broken file is reported here, not after a queued process loads a model
        if RunDir(run_dir).exists():
            raise FinetuneError(f"output.dir {run_dir} already holds a run",
                                hint="resume it from the run list, or change output.dir for a new run")
        path = self.manager.new_recipe_path()
        path.write_text(recipe_to_yaml(recipe))
        self.manager.submit(path, run_dir)
        return run_dir

    def resume(self, run_dir: str, allow_data_change: bool = False) -> Path:
        """Queue the continuation of a stopped run from its newest checkpoint (refused by the run if its data
        changed since it started, unless `allow_data_change`)."""
        path = self.checked_run(run_dir)
        RunDir(path).refuse_if_locked("resume")
        recipe = RunDir(path).recipe
        if not recipe.is_file():
            raise FinetuneError(f"{path} has no {recipe.name}, so it cannot be resumed")
        self.refuse_user_code(api.load_recipe(recipe))
        self.manager.submit(recipe, path, resume=True, allow_data_change=allow_data_change)
        return path

    def refuse_user_code(self, recipe: Recipe) -> None:
        """GRPO rewards of kind python run code from files on this server: only when it was started allowing
        it (`finetune ui --allow-python-rewards`), whatever the recipe's trust key says."""
        keys = recipe.grpo.python_keys("grpo.")
        if keys and not self.settings.allow_python_rewards:
            raise FinetuneError(f"{', '.join(keys)}: kind python runs code from a file on this server, and this web "
                                "UI was started without allowing that",
                                hint="use a built-in reward kind (answer, format, length), run the recipe with "
                                     "`finetune run`, or start the UI with `finetune ui --allow-python-rewards`")

    def stop(self, run_dir: str) -> str:
        return self.manager.stop(self.run_path(run_dir, must_exist=False))

    def run_path(self, run_dir: str | None, must_exist: bool = True) -> Path:
        """A run directory named by the page, refused outside the allowed folders."""
        return allowed_path(run_dir or "", self.settings.roots, "run", must_exist=must_exist)

    def checked_run(self, run_dir: str | None) -> Path:
        """A run directory whose recipe (read again by resume, chat and export) stays in the allowed folders."""
        path = self.run_path(run_dir)
        run = RunDir(path)
        text = run.read_recipe_text()
        if text is not None:
            check_recipe_paths(load_recipe_text(text, str(run.recipe)), self.settings.roots)
        return path

    def run_recipe(self, run_dir: str | None) -> str:
        """A run's resolved recipe.yaml ('' while it has none)."""
        return RunDir(self.run_path(run_dir)).read_recipe_text() or ""

    def run_dirs(self) -> list[str]:
        """Runs the page can show, newest first: queued or starting ones (no files yet), then on disk."""
        jobs = self.manager.jobs()
        found = [str(p) for p in find_runs(self.settings.runs_dir, [Path(j.run_dir) for j in jobs])]
        pending = [j.run_dir for j in reversed(jobs) if j.state in ("queued", "running") and j.run_dir not in found]
        return pending + found

    def outside_runs(self) -> list[HeldRun]:
        """Runs in the runs folder and the allowed folders that a process started outside this UI holds."""
        return self.manager.outside_runs([self.settings.runs_dir, *self.settings.allow_dirs])

    def chat_runs(self) -> list[str]:
        """The runs the chat can load, newest first: those with a saved adapter (not failed or unstarted ones)."""
        return [d for d in self.run_dirs() if RunDir(Path(d)).has_adapter()]

    def current_run(self) -> str | None:
        """The run a freshly opened page should show: the running one, else the newest."""
        for job in reversed(self.manager.jobs()):
            if job.state in ("running", "queued"):
                return job.run_dir
        dirs = self.run_dirs()
        return dirs[0] if dirs else None

    # -- results -------------------------------------------------------------------------------------
    def apply_advice(self, values: list[Any], run_dir: str | None) -> tuple[str, dict[int, Any]]:
        """A finished run's batch advice written over the form's recipe, as `finetune plan --advice RUN_DIR`
        does (finetune.api.apply_advice): a message naming the keys it set, and widget index -> new value."""
        path = self.run_path(run_dir)
        try:
            recipe = self.recipe(values)
        except RecipeError as exc:
            raise RecipeError(f"the recipe form must hold a valid recipe to take the advice of {path.name}",
                              exc.problems, hint="load one first in the Recipe tab (for example this run's, "
                                                 "under 'From a previous run'), then press the button again") from None
        advised, keys_set, why = api.apply_advice(recipe, path)
        data = advised.model_dump(mode="python")
        index = {s.key: i for i, s in enumerate(self.specs)}
        changed = {}
        for key in (item.split("=", 1)[0] for item in keys_set):
            section, name = key.split(".")
            changed[index[key]] = form.to_widget(self.specs[index[key]], data[section][name])
        shown = ", ".join(f"`{self.specs[i].key}={v}`" for i, v in changed.items())
        return (f"Wrote the advice of {path.name} into the recipe form (Recipe tab): {shown}. Why: {why}. "
                "Check the plan in the Memory tab before starting."), changed

    def chat_run(self, run_dir: str | None, what: str) -> str:
        """A run the chat may load: chosen, inside the allowed folders, with a saved adapter."""
        if not run_dir:
            raise FinetuneError(f"choose a {what} first", hint="runs appear here once they have saved an adapter")
        path = self.checked_run(run_dir)
        if not RunDir(path).has_adapter():
            raise FinetuneError(f"{path} has no adapter yet: chat once the run has saved one")
        return str(path)

    def chat(self, requests: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Stream the chat worker's answers to `requests` (one per column), queued behind training."""
        return self.chat_worker.chat(requests)

    def export(self, run_dir: str, out_dir: str, timeout: float = 3600, gguf: api.GGUFOptions | None = None,
               ) -> Iterator[str | api.ExportStep]:
        """Merge and save through `finetune export --progress json` in a separate process (it loads the full
        model) once no training run holds the GPU, with the chat worker stopped; yields a line while it waits
        for the GPU, then each step (`api.ExportStep`, read from the JSON lines) as it starts.
        `gguf`: one GGUF file of that type (and an Ollama Modelfile) instead of safetensors."""
        run = self.checked_run(run_dir)
        RunDir(run).refuse_if_locked("export")
        out = allowed_path(out_dir, self.settings.roots, "export folder")
        with self.chat_worker.gpu() as waiting:
            for event in waiting:
                yield f"waiting for the training run {event['run']} to finish"
            self.chat_worker.release()
            cmd = [sys.executable, "-m", "finetune", "export", str(run), "--out", str(out), "--progress", "json"]
            if gguf is not None:
                cmd += ["--format", "gguf", "--type", gguf.type, *(["--ollama"] if gguf.ollama else [])]
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=self.manager.child_env(), cwd=self.manager.cwd) as proc:
                timer = threading.Timer(timeout, proc.kill)
                timer.start()
                output, error = [], None  # other lines: what a library printed, shown if the export fails
                for line in proc.stdout:
                    event = api.ExportStep.read(line)
                    if isinstance(event, api.ExportStep):
                        yield event
                    elif event is not None:
                        error = event.get("error", error)
                    else:
                        output.append(line.rstrip("\n"))
                timer.cancel()
        if proc.returncode != 0:
            raise FinetuneError(f"export failed (exit code {proc.returncode})",
                                [error] if error else ["\n".join(output[-40:])])
