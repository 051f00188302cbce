"""Use a finished run: load base + adapter, export a merged safetensors model (its answers: finetune.model.chat)."""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from finetune.data.formats import RecordError
from finetune.data.images import image_size
from finetune.errors import FinetuneError, UsageError
from finetune.export.files import GGUFOptions, write_gguf_export
from finetune.export.gguf import check_exportable
from finetune.export.gguf_vision import check_vision_exportable
from finetune.export.progress import ExportStep
from finetune.model.load import compute_dtype, load_full, load_model, load_tokenizer
from finetune.model.source import takes_images
from finetune.publish import pause_point, publishing
from finetune.recipe.load import load_recipe
from finetune.recipe.schema import Recipe
from finetune.rundir import EXPORT_MARKER, RunDir
from finetune.units import format_bytes


def load_run(run_dir: str | Path) -> tuple[Recipe, RunDir]:
    """The recipe a finished run trained with, and its run directory; a clear error if it has no adapter yet."""
    run = RunDir(Path(run_dir))
    if not run.recipe.is_file():
        raise UsageError(f"{run.root} is not a run directory (no {run.recipe.name})")
    if not run.has_adapter():
        raise UsageError(f"{run.root} has no trained adapter yet ({run.adapter.name}/ is missing)",
                            hint="finish the run first, or resume it with finetune run RECIPE --resume")
    return load_recipe(run.recipe), run


def base_model_key(recipe: Recipe) -> tuple:
    """Which loaded base model a run's adapter goes on, as a value to compare: the model (its folder resolved
    where it is one, so two spellings of a folder agree; the revision; trust_remote_code, which may swap the
    modelling code), the dtype it loads in on this machine and the quantization (its 4-bit options only with 4
    bits). Runs with equal keys share one loaded base: in chat (ChatModels) and in compare_runs
    (load_adapters), the one definition of "the same base model". The attention kernel is not part of it: it
    changes how the weights are used, not which."""
    model, quant = recipe.model, recipe.quantization
    folder = Path(model.path).expanduser()
    path = str(folder.resolve()) if folder.exists() else model.path
    bits = (quant.bits, quant.quant_type, quant.double_quant) if quant.bits == 4 else (quant.bits,)
    return path, model.revision, model.trust_remote_code, str(compute_dtype(model)), bits


# How a finished run's base loads, passed down by finetune.api (finetune.train.streamed_load.streamed_use, which
# this layer may not import): called with the run's recipe and directory, a block yielding `arriving` (entered
# around the base's load, None: whole) and `attach(model)` (the store's hooks on the loaded model); the store
# closes, its files removed, when the block ends. None: the base loads whole.
Streaming = Callable[[Recipe, Path], AbstractContextManager]


@contextmanager
def loaded(run_dir: str | Path, streaming: Streaming | None,
           load: Callable[[AbstractContextManager | None], tuple]) -> Iterator[tuple]:
    """`load(arriving)`'s (model, ...) for the block, its base loaded as `streaming` says for the run in
    `run_dir` (through the weight store where the run streamed it); the store closes when the block ends."""
    if streaming is None:
        yield load(None)
        return
    recipe, run = load_run(run_dir)
    with streaming(recipe, run.root) as use:
        models = load(use.arriving)
        use.attach(models[0])
        yield models


def load_trained(run_dir: str | Path, *, use_adapter: bool = True, quantize: bool = True,
                 arriving: AbstractContextManager | None = None):
    """(model, tokenizer) for a run: the base as trained (quantized if it was) with the adapter applied.
    `arriving`: entered around the base's load (its weights streamed as the run trained: `loaded`)."""
    recipe, run = load_run(run_dir)
    if recipe.adapter.type == "full":
        if not use_adapter:
            model, tokenizer, _ = load_model(recipe.model, recipe.quantization, quantize=False)
            return model.eval(), tokenizer
        return load_full(run.adapter).eval(), load_tokenizer(run.adapter, recipe.model)
    model, tokenizer, _ = load_model(recipe.model, recipe.quantization, quantize=quantize, arriving=arriving)
    tokenizer = load_tokenizer(run.adapter, recipe.model)  # carries the chat template used in training
    if use_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, run.adapter)
    return model.eval(), tokenizer


def lineage(run_dirs: list[str | Path]) -> list[tuple[Path, str]]:
    """[(run directory, label)]: each run preceded by the runs its adapter started from (adapter.init_from,
    followed back while it names a run directory with an adapter), oldest first, each run once. A run added
    this way is labelled "NAME (start of CHILD)", the runs given by their folder name."""
    out: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for run_dir in run_dirs:
        chain = [(Path(run_dir), Path(run_dir).name)]
        while True:
            parent = load_run(chain[-1][0])[0].adapter.init_from
            if parent is None or not RunDir(Path(parent)).has_adapter() or not RunDir(Path(parent)).recipe.is_file():
                break
            parent = Path(parent)
            if parent.resolve() in seen | {run.resolve() for run, _ in chain}:
                break
            chain.append((parent, f"{parent.name} (start of {chain[-1][0].name})"))
        for run, label in reversed(chain):
            if run.resolve() not in seen:
                seen.add(run.resolve())
                out.append((run, label))
    return out


def load_adapters(run_dirs: list[str | Path], *, quantize: bool = True, arriving: AbstractContextManager | None = None):
    """(model, tokenizer, adapter names): one base model with the LoRA adapters of several runs loaded side by
    side (an SFT run and a DPO run on top of it, say), so each answer comes from the same base weights.

    The runs must share the base model (`base_model_key`); select one with `model.set_adapter(name)`, the
    base alone with `model.disable_adapter()`. `arriving`: as `load_trained`'s."""
    loaded = [load_run(d) for d in run_dirs]
    first = loaded[0][0]
    for recipe, run in loaded:
        if recipe.adapter.type == "full":
            raise UsageError(f"{run.root} is a full fine-tune, not an adapter: it cannot share a base model",
                                hint="compare LoRA runs, or compare a full fine-tune with its base alone")
        if base_model_key(recipe) != base_model_key(first):
            raise UsageError(
                f"{run.root} trained on {_describe_base(recipe)}, {loaded[0][1].root} on "
                f"{_describe_base(first)}",
                hint="compare runs trained on the same base model, revision, dtype and quantization")
    from peft import PeftModel

    model, _, _ = load_model(first.model, first.quantization, quantize=quantize, arriving=arriving)
    names = [f"run{i}" for i in range(len(loaded))]
    model = PeftModel.from_pretrained(model, loaded[0][1].adapter, adapter_name=names[0])
    for name, (_, run) in zip(names[1:], loaded[1:], strict=True):
        model.load_adapter(run.adapter, adapter_name=name)
    return model.eval(), load_tokenizer(loaded[-1][1].adapter, first.model), names


def _describe_base(recipe: Recipe) -> str:
    model, quant = recipe.model, recipe.quantization
    revision = f"@{model.revision}" if model.revision else ""
    dtype = str(compute_dtype(model)).removeprefix("torch.")
    bits = {4: f"4-bit {quant.quant_type}", 8: "8-bit"}.get(quant.bits, "not quantized")
    return f"{model.path}{revision} ({dtype}, {bits}{', remote code' if model.trust_remote_code else ''})"


def reads_images(recipe: Recipe) -> bool:
    """Whether the run's model takes images (finetune.model.source.takes_images)."""
    return takes_images(recipe.model.path, recipe.model.revision)


def check_image(run_dir: str | Path, image: str | Path | None) -> Path | None:
    """The image to ask the run about, checked before any model loads as a training record's image is
    (finetune.data.images: readable, whole, decodes, within the decompression-bomb limit and the aspect ratio),
    and the run's model reads images. None without an image."""
    if image is None:
        return None
    path = Path(image).expanduser()
    if not path.is_file():  # a path holding a NUL byte included: no file has one, and it is shown escaped
        shown = str(image).replace("\x00", "\\x00")
        raise UsageError(f"--image {shown}: no such file", hint="give the path of a local image file")
    try:
        image_size(str(path))
    except RecordError as exc:
        raise UsageError(f"--image: {exc}", hint="give a PNG, JPEG, WebP or another image file") from None
    recipe, run = load_run(run_dir)
    if not reads_images(recipe):
        raise UsageError(f"--image: {run.root} trained the text-only model {recipe.model.path}, which reads no "
                         "images", hint="leave out --image, or give a run of a vision-language model")
    return path.resolve()


def vision_of(run_dir: str | Path, model, tokenizer):
    """The image processor and image token a run's vision-language model reads images with
    (finetune.data.vision.VisionData, as the run trained: its data.max_pixels), None for a text model."""
    from finetune.model.source import resolve_model_path
    from finetune.model.vision import vision_data

    recipe, _ = load_run(run_dir)
    if not reads_images(recipe):
        return None
    max_pixels = getattr(recipe.data, "max_pixels", None)  # data.max_pixels, resolved in the run's recipe
    return vision_data(model.config, resolve_model_path(recipe.model.path, recipe.model.revision), tokenizer,
                       max_pixels if isinstance(max_pixels, int) else None)


def _check_export_target(out: Path) -> None:
    """Replace only an empty folder or an earlier export: never a folder holding other files (the allowed
    folder itself, a home, a project), whatever --out names."""
    if not out.exists():
        return
    if not out.is_dir() or (any(out.iterdir()) and not (out / EXPORT_MARKER).is_file()):
        raise UsageError(f"export: {out} already exists and holds files that finetune export did not write; "
                            "not replacing it", hint="choose a new --out folder, or delete that one yourself")


EXPORT_STEPS = ("loading the base model", "merging the adapter into it", "saving the merged model",
                "moving the merged model into place")


def _export_step(progress: Callable[[ExportStep], None]) -> Callable[[int, str], None]:
    """Announce step i; FINETUNE_FAULT_PAUSE=export:N (tests) stops the export as step N starts."""
    def step(i: int, detail: str) -> None:
        progress(ExportStep(i + 1, len(EXPORT_STEPS), EXPORT_STEPS[i], detail))
        pause_point(f"export:{i + 1}")
    return step


def export_merged(run_dir: str | Path, out_dir: str | Path,
                  progress: Callable[[ExportStep], None] = lambda step: None, gguf: GGUFOptions | None = None
                  ) -> Path:
    """Merge the LoRA adapter into the base and save safetensors (QLoRA: into the dequantized base), or with
    `gguf` one GGUF file (finetune.export). `progress` gets an ExportStep ("[2/4] merging the adapter into
    it: DETAIL") as each of EXPORT_STEPS starts (a large model's merge takes minutes, and the page shows where it is). The
    folder is published whole (finetune.publish): a stop or a kill at any step leaves the earlier export in
    place and no temporary."""
    recipe, run = load_run(run_dir)
    if gguf is not None and gguf.ollama and reads_images(recipe):
        raise UsageError(f"export --ollama: {recipe.model.path} is a vision-language model, whose GGUF export is "
                         "two files (the language model and its projector) that a Modelfile does not import",
                         hint="leave out --ollama and load both with llama-mtmd-cli -m MODEL.gguf --mmproj "
                              "mmproj-MODEL.gguf")
    step = _export_step(progress)
    out = Path(out_dir)
    with _writing(out), publishing(out) as tmp:  # settles what a killed export left before the target is checked
        _check_export_target(out)
        if gguf is None:
            _write_merged(recipe, run, tmp, step)
        else:
            _check_gguf_exportable(recipe, run)
            model, tokenizer = merged_model(recipe, run, step)
            vision = vision_of(run_dir, model, tokenizer)
            write_gguf_export(model, tokenizer, tmp, gguf, name=run.root.resolve().name,
                              system_prompt=recipe.data.system_prompt, step=step,
                              image_processor=vision.processor if vision is not None else None)
        (tmp / EXPORT_MARKER).touch()
        mode = (tmp / EXPORT_MARKER).stat().st_mode & 0o777  # what the umask gives a new file
        for written in tmp.rglob("*"):  # safetensors writes its file 0600; the export is readable alike
            if written.is_file():
                written.chmod(mode)
        files = sorted(tmp.glob("*.safetensors")) + sorted(tmp.glob("*.gguf"))
        size = format_bytes(sum(p.stat().st_size for p in files))
        step(3, f"{len(files)} {'GGUF' if gguf else 'safetensors'} file(s), {size} -> {out}")
    return out


# errno of a write that fails for the folder's disk, not for the export: it is read-only or full
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@contextmanager
def _writing(out: Path) -> Iterator[None]:
    """An export's write that fails for its --out folder (read-only, full, under a regular file, a name too
    long) as one line naming the folder and the fix; `publishing` has already removed the unfinished copy and
    kept an earlier export. Other errors pass as they are."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        text = str(exc)
        os_error = re.search(r"os error (\d+)|code: (\d+)", text)  # safetensors' IoError names no errno itself
        code = getattr(exc, "errno", None) or (int(os_error.group(1) or os_error.group(2)) if os_error else None)
        folder = out.absolute().parent
        if code in (errno.EEXIST, errno.ENOTDIR):
            blocker = next((p for p in (out.absolute(), *out.absolute().parents) if p.exists() and not p.is_dir()),
                           folder)
            raise UsageError(f"export: --out {out} cannot be made: {blocker} is a file, not a folder",
                             hint="choose a --out whose parent folders are folders") from None
        if code in _READ_ONLY or code == errno.ENAMETOOLONG:
            raise UsageError(f"export: cannot write into {folder} ({exc.strerror or text})",
                             hint="choose a --out on a writable disk, with folder names the disk allows") from None
        if code in _FULL or " requested and " in text:  # numpy's short write of a GGUF tensor
            what = "takes no file that large" if code == errno.EFBIG else "ran out of space"
            raise FinetuneError(f"export: {folder} {what} while the model was written ({text}); "
                                "nothing was replaced", hint="free space there, or choose a --out on a disk with "
                                "room for the model (an earlier export there is kept)") from None
        raise


def _check_gguf_exportable(recipe: Recipe, run: RunDir) -> None:
    """Refuse, from the config alone, a model the GGUF writer does not write: before minutes of loading and
    merging, not after."""
    from transformers import AutoConfig

    from finetune.model.family import text_config
    from finetune.model.source import resolve_model_path

    folder = run.adapter if recipe.adapter.type == "full" else resolve_model_path(recipe.model.path,
                                                                                  recipe.model.revision)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=recipe.model.trust_remote_code)
    if reads_images(recipe):
        check_vision_exportable(config)
    else:
        check_exportable(text_config(config))


def _write_merged(recipe: Recipe, run: RunDir, tmp: Path, step: Callable[[int, str], None]) -> None:
    if recipe.adapter.type == "full":
        step(0, f"full fine-tune: copying {run.adapter}")
        shutil.copytree(run.adapter, tmp, dirs_exist_ok=True)
    else:
        model, tokenizer = merged_model(recipe, run, step)
        step(2, f"safetensors shards in {tmp} (a temporary folder, renamed when complete)")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    copy_processor_files(recipe, run, tmp)


# What a vision-language model's processor reads beside the tokenizer: the image (and video) preprocessing and
# the processor's chat template. An export without them loads as a text model only.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")


def copy_processor_files(recipe: Recipe, run: RunDir, out: Path) -> list[str]:
    """Copy the processor files a merged model needs into `out`: from the run's adapter folder where training
    saved them, else from the base model's folder; a file already written (the tokenizer's chat template) is
    kept. Returns the names copied."""
    from finetune.model.source import resolve_model_path

    if not reads_images(recipe):
        return []
    base = resolve_model_path(recipe.model.path, recipe.model.revision)
    copied = []
    for name in PROCESSOR_FILES:
        source = next((folder / name for folder in (run.adapter, base) if (folder / name).is_file()), None)
        if source is not None and not (out / name).exists():
            shutil.copyfile(source, out / name)
            copied.append(name)
    return copied


def merged_model(recipe: Recipe, run: RunDir, step: Callable[[int, str], None] = lambda i, detail: None):
    """(model, tokenizer): the run's adapter merged into its base (a full fine-tune as saved), in memory."""
    if recipe.adapter.type == "full":
        step(0, f"full fine-tune from {run.adapter}")
        return load_full(run.adapter), load_tokenizer(run.adapter, recipe.model)
    from peft import PeftModel

    step(0, recipe.model.path)
    model, _, _ = load_model(recipe.model, recipe.quantization)
    step(1, f"{recipe.adapter.type} adapter from {run.adapter}")
    if recipe.quantization.bits in (4, 8):
        # The adapter learned against the quantized weights: merge into exactly those, dequantized.
        model = model.dequantize()
    model = PeftModel.from_pretrained(model, run.adapter).merge_and_unload()
    return model, load_tokenizer(run.adapter, recipe.model)  # the tokenizer carries the training chat template
