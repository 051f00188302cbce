"""`finetune` command line: a thin shell over finetune.api. User mistakes print a message, never a traceback."""

from __future__ import annotations

import argparse
import sys

from rich.markup import escape

from finetune import __version__
from finetune.console import console, result
from finetune.errors import FinetuneError, UsageError
from finetune.export.gguf import TYPES as GGUF_TYPES

SET_HELP = "override a recipe key, e.g. --set training.max_steps=10 (repeatable; `finetune keys` lists keys)"


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, not {text!r}")
    return value


def _gpu_memory(text: str) -> list[str]:
    """--gpu-memory: a size with its unit, or auto, or several sizes separated by commas (one plan per size),
    checked here. A bare number would be bytes, never what was meant; GB reads as GiB, as a card's label means
    it (finetune.units.gpu_size), with a line saying so."""
    from finetune.units import gpu_size, parse_bytes

    units = "give a size with its unit, e.g. 12GiB, 24GB or 512MiB (GB reads as GiB, as GPUs are labelled; " \
            "MB: powers of 10), or auto"
    sizes = [item.strip() for item in text.split(",")]
    several = len(sizes) > 1
    for i, size in enumerate(sizes, 1):
        where = f"{text!r}: size {i}, {size!r}," if several else f"{size!r}"
        if not size:
            raise argparse.ArgumentTypeError(f"{text!r}: size {i} is empty; give sizes with their units separated "
                                             "by commas, e.g. 8GiB,12GiB,16GiB,24GiB")
        if size.replace(".", "", 1).isdigit():
            raise argparse.ArgumentTypeError(f"{where} has no unit; {units}")
        try:
            parse_bytes(size)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{where}: {exc}; {units}") from None
        if several and size == "auto":
            raise argparse.ArgumentTypeError(f"{text!r}: auto (this GPU's free memory) plans alone; a list "
                                             "takes sizes, e.g. 8GiB,12GiB,16GiB,24GiB")
    read = [gpu_size(size) for size in sizes]
    for _, note in read:
        if note is not None:
            console.print(f"--gpu-memory: {note}", markup=False, highlight=False)
    return [size for size, _ in read]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="Fine-tune open LLMs on one GPU, memory planned first.")
    parser.add_argument("--version", action="version", version=f"finetune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="fine-tune as a recipe says")
    _add_recipe_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output.dir")
    p.add_argument("--overwrite", action="store_true", help="delete a previous run in output.dir and start over")
    p.add_argument("--allow-data-change", action="store_true", help="with --resume: continue even though the "
                   "data differs from what the run started on (records, content, tokenizer, max_seq_len, ...); "
                   "without it such a resume is refused")
    p.add_argument("--no-plan", action="store_true", help="train without a memory plan (as memory.plan: false): "
                   "nothing predicts whether a step fits; without it a plan that cannot be made stops the run")
    p.add_argument("--gpus", type=_positive_int, metavar="N", help="train on N GPUs of this machine (N processes "
                   "started with torchrun; on a machine without CUDA, N CPU processes over gloo); under torchrun "
                   "or accelerate launch leave it out: the launcher's WORLD_SIZE is used")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("validate", help="check a recipe without loading anything")
    _add_recipe_args(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="predict peak memory per component and pick the fastest settings that fit")
    _add_recipe_args(p)
    p.add_argument("--gpu-memory", type=_gpu_memory, metavar="SIZE", help="budget such as 12GiB, 24GB (read as "
                   "24GiB, as GPUs are labelled) or 512MiB, or auto (free memory of this GPU); several sizes separated by commas (8GiB,12GiB,16GiB,24GiB) "
                   "print one row per size; default: the recipe's memory.gpu_memory")
    p.add_argument("--device", choices=["cuda", "cpu"], help="plan for this device (default: cuda if present or "
                   "a GPU size is given here or in memory.gpu_memory, else cpu)")
    p.add_argument("--gpus", type=_positive_int, metavar="N", help="plan per device for N GPUs "
                   "(distributed.gpus; default: the recipe's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--advice", metavar="RUN_DIR", help="use the batch, learning rate and betas a finished run "
                   "advises from its measured noise scale (results.json); --set still wins")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("measure", help="run N real training steps and report the measured peak and breakdown")
    _add_recipe_args(p)
    p.add_argument("--steps", type=_positive_int, default=2, metavar="N", help="training steps to run")
    p.add_argument("--json", action="store_true", help="print the measurement as JSON")
    p.set_defaults(func=cmd_measure)

    # `finetune ui ...` is handed to ui.app.main as is (see main); listed here for --help.
    sub.add_parser("ui", help="start the web UI on 127.0.0.1:7860 (finetune ui --help for its options)")

    p = sub.add_parser("keys", help="list every recipe key with its type, default and description")
    p.add_argument("section", nargs="?", help="only this section, e.g. training")
    p.add_argument("--markdown", action="store_true", help="print the Markdown reference (docs/recipe.md)")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("models", help="list the model families finetune trains, with what each supports")
    p.add_argument("--markdown", action="store_true", help="print the Markdown table (docs/models.md)")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="answer a prompt with a trained run (base + adapter)")
    p.add_argument("run_dir", help="a run directory (output.dir of a finished run)")
    p.add_argument("--prompt", required=True, help="user message; the chat template is applied")
    p.add_argument("--image", metavar="PATH", help="a local image the prompt asks about (a run of a "
                   "vision-language model; the image goes before the prompt in the user turn)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N",
                   help="length limit of the answer")
    p.add_argument("--no-adapter", action="store_true", help="answer with the base model alone")
    p.add_argument("--compare", nargs="*", metavar="OTHER_RUN", default=None,
                   help="print the base model's answer next to the fine-tuned one; with other run directories, "
                        "their answers too, side by side; a run started from another run's adapter "
                        "(adapter.init_from, e.g. DPO after SFT) shows that run's answer too")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("export", help="merge the adapter into the base and save safetensors or GGUF")
    p.add_argument("run_dir", help="a run directory")
    p.add_argument("--out", required=True, help="folder to write the merged model to")
    p.add_argument("--format", choices=["safetensors", "gguf"], default="safetensors",
                   help="safetensors shards (transformers) or one GGUF file (llama.cpp, Ollama)")
    p.add_argument("--type", default="f16", help=f"GGUF weight type: {', '.join(GGUF_TYPES)} (1-D tensors stay "
                   "f32); for k-quants such as Q4_K_M run llama.cpp's llama-quantize on an f16 file")
    p.add_argument("--ollama", action="store_true", help="with --format gguf: write an Ollama Modelfile beside it")
    p.add_argument("--progress", choices=["text", "json"], default="text",
                   help="stdout: 'export [i/n] step: detail' lines (text), or for programs one JSON object per "
                        "line: {\"step\", \"of\", \"label\", \"detail\"} per step, then {\"done\": folder} or "
                        "{\"error\": message, \"exit_code\": n} (json)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="held-out loss, perplexity and answer matches of a run (vs its base model); "
                       "of a dpo, orpo, simpo or cpo run: preference accuracy and margins on held-out pairs")
    p.add_argument("run_dir", help="a run directory")
    p.add_argument("--data", help="records the run did not train on (any training data format; chosen/rejected "
                   "pairs for a dpo, orpo, simpo or cpo run); a chat record's "
                   "last answer, or its \"expected\" string, is what a generation is matched to (default: the "
                   "records the run's data.validation_split held out of its training data)")
    p.add_argument("--compare", nargs="*", metavar="OTHER_RUN", default=None,
                   help="also evaluate the base model, and the other run directories given, side by side")
    p.add_argument("--max-new-tokens", type=_positive_int, metavar="N", help="length limit of each answer "
                   "(default: twice the longest expected answer's tokens + 16; an answer also ends at the model's "
                   "end of turn); the answers cut there are counted under the table")
    p.set_defaults(func=cmd_eval)
    return parser


def cmd_run(args) -> int:
    import os

    from finetune import api

    if args.allow_data_change and not args.resume:
        raise UsageError("--allow-data-change applies to --resume (a new run has no earlier data to differ from)",
                         hint="add --resume, or leave --allow-data-change out")
    world = os.environ.get("WORLD_SIZE")  # started by torchrun / accelerate launch: one of its processes
    if world is not None and args.gpus is not None:
        raise FinetuneError("--gpus is for starting processes; under torchrun or accelerate launch the world "
                            f"size ({world}) comes from the launcher", hint="leave out --gpus")
    gpus = args.gpus or world
    if args.no_plan:
        args.overrides = [*args.overrides, "memory.plan=false"]
    overrides = [*args.overrides, f"distributed.gpus={gpus}"] if gpus else args.overrides
    recipe = api.load_recipe(args.recipe, overrides)  # checked here, before any process starts
    if world is None and recipe.distributed.gpus > 1:  # --gpus N, or distributed.gpus in the recipe (the UI)
        argv = ["run", args.recipe, *(f"--set={o}" for o in args.overrides),
                *(["--resume"] if args.resume else []), *(["--overwrite"] if args.overwrite else []),
                *(["--allow-data-change"] if args.allow_data_change else [])]
        return api.launch(recipe, argv, recipe.distributed.gpus, resume=args.resume, overwrite=args.overwrite)
    try:
        result = api.run(recipe, resume=args.resume, overwrite=args.overwrite,
                         allow_data_change=args.allow_data_change)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the first step
        newest = api.newest_checkpoint(recipe)
        kept = f"; {newest.name} is kept, continue with: {_resume_command(args)}" if newest is not None else ""
        console.print(f"[yellow]interrupted[/yellow]{escape(kept)}")
        return 130
    # under a launcher, rank 0 wrote the run directory: it alone reports the memory
    memory = api.run_memory(result.run_dir) if os.environ.get("RANK", "0") == "0" else None
    if memory is not None:
        from finetune.cli_tables import memory_line

        console.print(memory_line(memory), markup=False)
    if result.state == "stopped":
        console.print(f"[yellow]stopped at step {result.steps}; continue with: {escape(_resume_command(args))}")
        return 130
    loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
    console.print(f"[green]done[/green]: {result.steps} steps, final loss {loss}; adapter in {result.run_dir}/adapter")
    if result.eval_before and result.eval_after and "eval_reward" in result.eval_after:
        console.print(f"held-out reward (greedy answers): {result.eval_before['eval_reward']:.3f} before training, "
                      f"{result.eval_after['eval_reward']:.3f} after")
    return 0


def _resume_command(args) -> str:
    """The command that continues this run: the recipe and its --set overrides, --resume."""
    import shlex

    return shlex.join(["finetune", "run", args.recipe, *(f"--set={o}" for o in args.overrides), "--resume"])


def cmd_validate(args) -> int:
    from finetune import api

    recipe = api.load_recipe(args.recipe, args.overrides)
    data = api.preflight(recipe)
    bad = f", {data['bad_records']} malformed to skip" if data["bad_records"] else ""
    bad += f", {data['images']} images in {data['image_records']} records" if "images" in data else ""
    result.print(f"[green]ok[/green]: {escape(args.recipe)} is a valid recipe (model {escape(recipe.model.path)}, "
                  f"data {escape(recipe.data.label())}: {data['records']} {data['format']} records{bad}, "
                  f"adapter {recipe.adapter.type})")
    return 0


def cmd_plan(args) -> int:
    """Print the plan (JSON or tables); exit 0 if it fits, 1 if nothing fits."""
    from finetune import api

    overrides = [*args.overrides, f"distributed.gpus={args.gpus}"] if args.gpus else args.overrides
    if args.advice:
        recipe, advised, why = api.apply_advice(args.recipe, args.advice, overrides)
        if not args.json:
            print(f"advice from {args.advice}: {why}\n  " + "  ".join(f"--set {o}" for o in advised))
    else:
        recipe = api.load_recipe(args.recipe, overrides)
    api.preflight(recipe)  # the recipe's files, in seconds; api.plan itself also plans what-ifs without data
    sizes = args.gpu_memory or [None]
    if len(sizes) > 1:
        return _plan_sizes(args, recipe, sizes)
    plan = api.plan(recipe, gpu_memory=sizes[0], device=args.device)
    if args.json:
        print(plan.to_json())
    else:
        from finetune.cli_tables import render_plan  # imports torch: after the plan, so errors come at once

        render_plan(plan)
        for line in api.batch_plan(recipe, plan):
            print(line)
    if not plan.fits and (note := api.context_note(recipe)) is not None:
        console.print(note, markup=False, highlight=False)
    return 0 if plan.fits else 1


def _plan_sizes(args, recipe, sizes: list[str]) -> int:
    """`finetune plan --gpu-memory A,B,...`: one row per GPU size; exit 0 if the recipe fits any, 1 if none."""
    import json

    from finetune import api

    if args.device == "cpu":
        raise UsageError("--gpu-memory with several sizes plans GPUs of those sizes, not this CPU",
                         hint="leave out --device cpu, or give one --gpu-memory")
    report = api.plan_sizes(recipe, sizes)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from finetune.cli_tables import render_sizes

        render_sizes(report)
    return 0 if any(row["fits"] for row in report["sizes"]) else 1


def cmd_measure(args) -> int:
    """Print the measured peak and its breakdown (JSON or a table)."""
    import json

    from finetune import api
    from finetune.cli_tables import render_measurement

    result = api.measure(api.load_recipe(args.recipe, args.overrides), steps=args.steps)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render_measurement(result)
    return 0


def cmd_keys(args) -> int:
    """The reference on stdout (it is the command's output): plain text, or Markdown. On a terminal the text
    wraps to its width; piped or in a file, one line per key (for grep)."""
    import shutil

    from finetune.recipe.docs import reference_markdown, reference_text
    from finetune.recipe.load import iter_fields

    if args.section:
        sections = [key for key, _, is_section in iter_fields() if is_section]
        if args.section not in sections:
            raise UsageError(f"finetune keys: no section {args.section!r}", hint=f"sections: {', '.join(sections)}")
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    sys.stdout.write(reference_markdown() if args.markdown else reference_text(args.section, width))
    return 0


def cmd_models(args) -> int:
    """The family table on stdout: one line per family, or docs/models.md's Markdown."""
    from finetune.recipe.families import models_markdown, models_text

    sys.stdout.write(models_markdown() if args.markdown else models_text())
    return 0


def cmd_generate(args) -> int:
    from finetune import api

    # Other runs, or the runs this one started from (adapter.init_from): base, each of them, then this run.
    if args.compare or (args.compare is not None and len(api.lineage([args.run_dir])) > 1):
        answers = api.compare_runs([*args.compare, args.run_dir], args.prompt, image=args.image,
                                   max_new_tokens=args.max_new_tokens)
        from rich.console import Console
        from rich.table import Table

        table = Table(*(name for name, _ in answers), title=f"prompt: {escape(args.prompt)}", show_lines=True)
        table.add_row(*(escape(answer) for _, answer in answers))
        Console().print(table)  # the answers are the command's output: stdout
        return 0
    if args.compare is not None:
        base, tuned = api.compare(args.run_dir, args.prompt, image=args.image, max_new_tokens=args.max_new_tokens)
        shown = f"image:      {args.image}\n" if args.image else ""
        print(f"{shown}prompt:     {args.prompt}\nbase model: {base}\nfine-tuned: {tuned}")
        return 0
    print(api.generate(args.run_dir, args.prompt, image=args.image, max_new_tokens=args.max_new_tokens,
                       use_adapter=not args.no_adapter))
    return 0


def cmd_export(args) -> int:
    from finetune import api

    machine = args.progress == "json"
    try:
        if args.format != "gguf" and (args.ollama or args.type != "f16"):
            raise UsageError("export: --type and --ollama apply to --format gguf", hint="add --format gguf")
        gguf = api.GGUFOptions(args.type, args.ollama) if args.format == "gguf" else None
        # One line per step, printed as it starts (the UI reads the JSON form to show the export's progress).
        out = api.export(args.run_dir, args.out,
                         lambda step: print(step.to_json() if machine else f"export {step}", flush=True), gguf)
    except FinetuneError as exc:
        if machine:
            print(api.ExportStep.error_line(str(exc), exc.exit_code), flush=True)
        raise
    if machine:
        print(api.ExportStep.done_line(out), flush=True)
    console.print(f"[green]exported[/green] merged model to {out}")
    if args.ollama and not machine:  # json: stdout holds JSON lines only
        print(f"create the Ollama model with: {api.ollama_command(out)}")
    return 0


def cmd_eval(args) -> int:
    from finetune import api
    from finetune.cli_tables import render_evaluation

    report = api.evaluate(args.run_dir, args.data, compare=args.compare, max_new_tokens=args.max_new_tokens,
                          progress=lambda line: print(f"eval {line}", flush=True))
    render_evaluation(report)
    return 0


def error_text(exc: FinetuneError) -> str:
    """The message as rich markup that prints as written: a user's `[/x]` is text, not a tag that makes rich
    raise, and a lone surrogate from a badly encoded argument prints as an escape instead of failing to encode."""
    return escape(str(exc).encode("utf-8", "backslashreplace").decode("utf-8"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ui"]:
        from ui.app import main as ui_main

        return ui_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command not in ("validate", "keys", "models"):  # those never import torch: keep them instant
        from finetune.console import quiet_libraries

        quiet_libraries()
    try:
        return args.func(args)
    except FinetuneError as exc:
        console.print(f"[red]error:[/red] {error_text(exc)}", highlight=False)
        return exc.exit_code
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]")
        return 130

