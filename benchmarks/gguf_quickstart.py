"""The quickstart's GGUF export against the merged model it was written from.

    finetune run recipes/quickstart.yaml
    finetune export runs/quickstart --out runs/quickstart-gguf --format gguf --type q8_0 --ollama
    OMP_NUM_THREADS=1 python benchmarks/gguf_quickstart.py [RUN_DIR] [EXPORT_DIR]

Reads the GGUF back with the gguf reader, loads it with transformers (gguf_file=), compares its logits with
the merged model's (the run's adapter merged into the dequantized base, in float32, as export builds it) on
chat prompts, and lets both answer the prompts greedily. Writes benchmarks/results/gguf_quickstart-TYPE.txt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.model.chat import build_prompt, stream_reply  # noqa: E402
from finetune.model.trained import load_run, merged_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["What is your name?", "Who made you?", "Tell me a fun fact about memory budgets."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default="runs/quickstart")
    parser.add_argument("export_dir", nargs="?", default="runs/quickstart-gguf")
    args = parser.parse_args()
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = next(Path(args.export_dir).glob("*.gguf"))
    reader = gguf.GGUFReader(path)
    kinds = sorted({t.tensor_type.name for t in reader.tensors})
    recipe, run = load_run(args.run_dir)
    merged, tokenizer = merged_model(recipe, run)
    merged = merged.float().eval()
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    read_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    lines = [f"{path} ({path.stat().st_size / 2**20:.1f} MiB): {len(reader.tensors)} tensors of types "
             f"{', '.join(kinds)}, architecture {reader.fields['general.architecture'].contents()}; "
             f"read back as {type(loaded).__name__}"]
    for prompt in PROMPTS:
        text = build_prompt(tokenizer, [{"role": "user", "content": prompt}])
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        same_tokens = read_tokenizer(text, add_special_tokens=False).input_ids == ids[0].tolist()
        with torch.no_grad():
            a, b = merged(input_ids=ids).logits, loaded(input_ids=ids).logits
        diff = (a - b).abs().max().item() / a.abs().max().item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        lines.append(f"prompt {prompt!r}: tokens equal {same_tokens}; max |logit diff| / max |logit| {diff:.4f}; "
                     f"next-token argmax agrees at {agree:.0%} of {ids.shape[1]} positions")
        for label, model, tok in (("merged safetensors", merged, tokenizer), ("GGUF", loaded, read_tokenizer)):
            reply = stream_reply(model, tok, [{"role": "user", "content": prompt}], max_new_tokens=40)
            lines.append(f"  {label:>18}: {reply}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"gguf_quickstart-{path.suffixes[-2].lstrip('.')}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
