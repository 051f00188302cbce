"""The files a GGUF export writes into its (temporary) folder: NAME.TYPE.gguf and, for Ollama, a Modelfile."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.export.gguf import check_type, write_gguf
from finetune.export.gguf_vision import language_model, projector_path, write_projector
from finetune.export.gguf_vocab import end_of_turn
from finetune.export.modelfile import modelfile

MODELFILE = "Modelfile"


@dataclass(frozen=True)
class GGUFOptions:
    """`finetune export --format gguf --type TYPE [--ollama]`."""

    type: str = "f16"
    ollama: bool = False

    def __post_init__(self) -> None:
        check_type(self.type)


def model_name(run_name: str) -> str:
    """A file and Ollama model name from a run folder's name (lower case, [a-z0-9._-])."""
    return re.sub(r"[^a-z0-9._-]+", "-", run_name.lower()).strip("-.") or "model"


def write_gguf_export(model: Any, tokenizer: Any, folder: Path, options: GGUFOptions, *, name: str,
                      system_prompt: str | None, step: Callable[[int, str], None],
                      image_processor: Any = None) -> Path:
    """Write the GGUF file (and the Modelfile) into `folder`; returns the GGUF path. A vision-language model
    (`image_processor` given: the one the run trained with) is written as its language model plus the
    projector file beside it (finetune.export.gguf_vision)."""
    name = model_name(name)
    path = folder / f"{name}.{options.type}.gguf"
    step(2, f"GGUF {options.type} in {folder} (a temporary folder, renamed when complete)")
    layout = None
    if image_processor is not None:
        write_projector(model, image_processor, projector_path(folder, name, options.type), qtype=options.type,
                        name=name, tokenizer=tokenizer)
        model = language_model(model)
        layout = model.layout
    write_gguf(model, tokenizer, path, qtype=options.type, name=name, layout=layout)
    if options.ollama:
        stops = [tokenizer.convert_ids_to_tokens(i) for i in (end_of_turn(tokenizer), tokenizer.eos_token_id)
                 if i is not None]
        (folder / MODELFILE).write_text(modelfile(path.name, tokenizer, stops, system_prompt), encoding="utf-8")
    return path


def ollama_command(out: Path) -> str:
    """The one command that makes the exported model an Ollama model."""
    gguf = next(out.glob("*.gguf"))  # NAME.TYPE.gguf, and NAME may hold dots (model_name keeps them)
    return f"ollama create {gguf.name.rsplit('.', 2)[0]} -f {out / MODELFILE}"
