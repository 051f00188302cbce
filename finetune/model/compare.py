"""The same prompt answered by several models of one base, loaded once: a run's base and fine-tuned model
(`compare`), or the base and several runs with their LoRA adapters switched in turn (`compare_runs`). The base
loads as `streaming` says (finetune.api passes the weight store's load where the run streamed it); the store
closes, its files removed, once the answers are in."""

from __future__ import annotations

from pathlib import Path

from finetune.model.chat import generate as _generate
from finetune.model.trained import (
    Streaming,
    check_image,
    lineage,
    load_adapters,
    load_trained,
    loaded,
    vision_of,
)


def compare(run_dir: str | Path, prompt: str, *, image: str | Path | None = None,
            max_new_tokens: int = 128, streaming: Streaming | None = None) -> tuple[str, str]:
    """(base model's answer, fine-tuned answer) to the same prompt (and image); the model is loaded once."""
    image = check_image(run_dir, image)
    with loaded(run_dir, streaming, lambda arriving: load_trained(run_dir, arriving=arriving)) as (model, tokenizer):
        ask = {"image": image, "vision": vision_of(run_dir, model, tokenizer) if image else None,
               "max_new_tokens": max_new_tokens}
        tuned = _generate(model, tokenizer, prompt, **ask)
        if hasattr(model, "disable_adapter"):  # LoRA: the base is the same weights with the adapter switched off
            with model.disable_adapter():
                return _generate(model, tokenizer, prompt, **ask), tuned
    base, base_tokenizer = load_trained(run_dir, use_adapter=False)  # full fine-tune: load the original
    return _generate(base, base_tokenizer, prompt, **ask), tuned


def compare_runs(run_dirs: list[str | Path], prompt: str, *, image: str | Path | None = None,
                 max_new_tokens: int = 128, parents: bool = True, streaming: Streaming | None = None
                 ) -> list[tuple[str, str]]:
    """[(label, answer)]: the base model's answer, then each run's (labelled by its folder; e.g. an SFT run, then
    a DPO run trained after it), all from one loaded base with the runs' LoRA adapters switched in turn.
    `parents`: a run started from another run's adapter (adapter.init_from) brings that run in before it,
    labelled "NAME (start of CHILD)", so a DPO run alone shows base, SFT and DPO. With `image`, every model is
    asked about it."""
    runs = lineage(list(run_dirs)) if parents else [(Path(d), Path(d).name) for d in run_dirs]
    for run, _ in runs:
        image = check_image(run, image)
    folders = [run for run, _ in runs]
    with loaded(folders[0], streaming,  # the base streamed as the first run's was
                lambda arriving: load_adapters(folders, arriving=arriving)) as (model, tokenizer, names):
        ask = {"image": image, "vision": vision_of(runs[-1][0], model, tokenizer) if image else None,
               "max_new_tokens": max_new_tokens}
        with model.disable_adapter():
            answers = [("base model", _generate(model, tokenizer, prompt, **ask))]
        for name, (_, label) in zip(names, runs, strict=True):
            model.set_adapter(name)
            answers.append((label, _generate(model, tokenizer, prompt, **ask)))
    return answers
