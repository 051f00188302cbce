"""What the GPU suite measures: the configurations of every stage, at full size (GPU) or shrunk (--cpu).

A configuration is a name and recipe overrides ({"section.key": value}); `suite.recipe_for` turns it into a
recipe on a random-weight model (model.path random:FOLDER) and synthetic text of at least max_seq_len tokens.
"""

from __future__ import annotations

QLORA = {"quantization.bits": 4, "adapter.type": "lora", "adapter.r": 16, "adapter.dropout": 0.0}
LORA_BF16 = {"quantization.bits": None, "adapter.type": "lora", "adapter.r": 16, "model.dtype": "bf16"}
FULL = {"quantization.bits": None, "adapter.type": "full"}
PLAIN = {"memory.offload": "none", "memory.chunked_loss": False, "memory.tiled_mlp": False}
CHUNKED = {**PLAIN, "memory.chunked_loss": True}
TILED = {**PLAIN, "memory.tiled_mlp": True}
OFFLOAD_CPU = {**PLAIN, "memory.offload": "cpu"}
OFFLOAD_DISK = {**PLAIN, "memory.offload": "disk"}
# training.method grpo (issue 28): prompt-only data (suite.prompt_data), a built-in reward, 4 answers per prompt.
GRPO = {"training.method": "grpo", "data.format": "auto", "grpo.num_generations": 4, "grpo.max_completion_length": 256,
        "grpo.rewards": [{"kind": "length", "max_chars": 400}]}
GRPO_ROW = "Qwen2.5-0.5B QLoRA GRPO 512+256 mb4 acc2"
LLAMA, QWEN7, QWEN05, MISTRAL, GEMMA = "llama-3.1-8b", "qwen2.5-7b", "qwen2.5-0.5b", "mistral-7b-v0.3", "gemma-2-9b"
GPT_OSS = "gpt-oss-20b"
MODELS = (LLAMA, QWEN7, QWEN05, MISTRAL, GEMMA, GPT_OSS)


def _cfg(name: str, model: str, seq: int, mb: int = 1, acc: int = 1, **keys) -> dict:
    return {"name": name, "model": model, "seq": seq, "mb": mb, "acc": acc, "keys": keys}


def _k(*parts: dict, **more) -> dict:
    out: dict = {}
    for p in parts:
        out.update(p)
    out.update({k.replace("__", "."): v for k, v in more.items()})
    return out


def stage_a() -> list[dict]:
    """Planner vs CUDA: >= 20 configurations through `finetune run`, 3 steps each."""
    opt = "optimizer.name"
    return [
        _cfg("Llama-3.1-8B QLoRA 2k", LLAMA, 2048, **_k(QLORA, PLAIN)),
        _cfg("Llama-3.1-8B QLoRA 8k", LLAMA, 8192, **_k(QLORA, PLAIN)),
        _cfg("Llama-3.1-8B QLoRA 32k chunked+tiled", LLAMA, 32768, **_k(QLORA, CHUNKED, TILED)),
        _cfg("Llama-3.1-8B QLoRA 8k offload cpu", LLAMA, 8192, **_k(QLORA, OFFLOAD_CPU)),
        _cfg("Llama-3.1-8B QLoRA 8k offload disk", LLAMA, 8192, **_k(QLORA, OFFLOAD_DISK)),
        _cfg("Llama-3.1-8B QLoRA 8k tiled MLP", LLAMA, 8192, **_k(QLORA, TILED)),
        _cfg("Llama-3.1-8B QLoRA 8k chunked loss", LLAMA, 8192, **_k(QLORA, CHUNKED)),
        _cfg("Llama-3.1-8B QLoRA 2k mb4", LLAMA, 2048, mb=4, **_k(QLORA, PLAIN)),
        _cfg("Llama-3.1-8B QLoRA 1k mb8", LLAMA, 1024, mb=8, **_k(QLORA, PLAIN)),
        _cfg("Llama-3.1-8B QLoRA 2k mb2 acc4", LLAMA, 2048, mb=2, acc=4, **_k(QLORA, PLAIN)),
        _cfg("Qwen2.5-7B LoRA bf16 2k", QWEN7, 2048, **_k(LORA_BF16, PLAIN)),
        _cfg("Qwen2.5-7B QLoRA 16k chunked", QWEN7, 16384, **_k(QLORA, CHUNKED)),
        _cfg("Gemma-2-9B QLoRA 2k", GEMMA, 2048, **_k(QLORA, PLAIN, model__attn_implementation="eager")),
        # attention sinks: `auto` picks flex attention on CUDA (never s x s scores), planned so; CPU cannot run it
        _cfg("gpt-oss-20b QLoRA 8k attention auto (flex, sinks)", GPT_OSS, 8192,
             **_k(QLORA, PLAIN, model__attn_implementation="auto")),
        _cfg("Mistral-7B DoRA 2k", MISTRAL, 2048, **_k(QLORA, PLAIN, adapter__type="dora")),
        _cfg("Mistral-7B QLoRA 4k mb2", MISTRAL, 4096, mb=2, **_k(QLORA, PLAIN)),
        *[_cfg(f"Qwen2.5-0.5B full {o}", QWEN05, 2048, mb=2, **_k(FULL, PLAIN, {opt: o}))
          for o in ("adamw", "adamw_8bit", "paged_adamw_8bit", "apollo_mini", "galore")],
        _cfg("Qwen2.5-0.5B full adamw layer-wise", QWEN05, 2048, mb=2,
             **_k(FULL, PLAIN, {opt: "adamw", "optimizer.layerwise": True})),
        _cfg("Qwen2.5-0.5B LoRA mb4 acc2", QWEN05, 1024, mb=4, acc=2, **_k(LORA_BF16, PLAIN)),
        *small_model_sweep(),
        # generation (8 answers: 2 prompts x 4) and training priced together, the peak the larger phase
        {**_cfg(GRPO_ROW, QWEN05, 768, mb=4, acc=2, **_k(QLORA, PLAIN, GRPO)), "prompts": 256},
    ]


def small_model_sweep() -> list[dict]:
    """The settings that matter on a model that loads in seconds (Qwen2.5-0.5B), for the first lease: QLoRA and
    LoRA bf16, the memory techniques at 8k, a large micro-batch (with the full fine-tunes with 8-bit and paged
    AdamW and the micro-batch 4 x accumulation 2 row of stage_a, the rest of the sweep)."""
    q = "Qwen2.5-0.5B QLoRA"
    return [
        _cfg(f"{q} 4k", QWEN05, 4096, **_k(QLORA, PLAIN)),
        _cfg("Qwen2.5-0.5B LoRA bf16 4k", QWEN05, 4096, **_k(LORA_BF16, PLAIN)),
        _cfg(f"{q} 8k chunked loss", QWEN05, 8192, **_k(QLORA, CHUNKED)),
        _cfg(f"{q} 8k tiled MLP", QWEN05, 8192, **_k(QLORA, TILED)),
        _cfg(f"{q} 8k offload cpu", QWEN05, 8192, **_k(QLORA, OFFLOAD_CPU)),
        _cfg(f"{q} 8k offload disk", QWEN05, 8192, **_k(QLORA, OFFLOAD_DISK)),
        _cfg(f"{q} 1k mb8", QWEN05, 1024, mb=8, **_k(QLORA, PLAIN)),
    ]


def stage_a_cpu() -> list[dict]:
    """The stage-a code paths on shrunk models, one configuration each: QLoRA with accumulation, offload cpu
    and disk, tiled MLP, chunked loss, Gemma-2 (eager), DoRA, a low-rank and a layer-wise full fine-tune, GRPO."""
    keep = ("Llama-3.1-8B QLoRA 2k mb2 acc4", "Llama-3.1-8B QLoRA 8k offload cpu", "Llama-3.1-8B QLoRA 8k offload disk",
            "Llama-3.1-8B QLoRA 8k tiled MLP", "Llama-3.1-8B QLoRA 8k chunked loss", "Gemma-2-9B QLoRA 2k",
            "Mistral-7B DoRA 2k", "Qwen2.5-0.5B full apollo_mini", "Qwen2.5-0.5B full adamw layer-wise", GRPO_ROW)
    return [c for c in stage_a() if c["name"] in keep]


# Unsloth's published maximum context for Llama-3.1-8B QLoRA (GB of GPU memory: tokens).
UNSLOTH_MAX_CONTEXT = {8: 2972, 12: 21848, 16: 40724, 24: 78475}
STAGE_B_RECIPE = _k(QLORA, {"memory.offload": "auto", "memory.chunked_loss": "auto", "memory.tiled_mlp": "auto"})


def stage_c_speed() -> list[dict]:
    """finetune run vs HF Trainer + PEFT vs TRL SFTTrainer, identical configuration."""
    return [_cfg(f"Llama-3.1-8B QLoRA 2k mb{mb}", LLAMA, 2048, mb=mb, **_k(QLORA, PLAIN)) for mb in (1, 4)]


# memory.kernels and training.compile, each against kernels none / compile off at the same length. Compile at 2k
# without checkpointing (a checkpointed layer breaks the graph: compile gains nothing there, which the 8k row
# with checkpointing shows on a real GPU); Liger with checkpointing as the planner leaves it.
KERNEL_VARIANTS = {
    "kernels none": {"memory.kernels": "none", "training.compile": False},
    "kernels liger": {"memory.kernels": "liger", "training.compile": False},
    "compile": {"memory.kernels": "none", "training.compile": True},
    "liger + compile": {"memory.kernels": "liger", "training.compile": True},
}
# memory.offload_weights forced on the 8B (it fits, so the planner would not stream): the link's real cost
# against the same run with the weights resident, and the planner's predicted tokens/s beside each.
STREAM_VARIANTS = {
    "weights resident": {"memory.offload_weights": "none"},
    "weights streamed cpu": {"memory.offload_weights": "cpu"},
    "weights streamed disk": {"memory.offload_weights": "disk"},
}


def stage_c_variants(seqs: tuple[int, ...] = (2048, 8192)) -> list[dict]:
    """Settings measured against a reference row of the same length (its `reference`): Liger and per-layer
    compile against kernels none (2k and 8k), weight streaming from RAM and disk against resident weights (2k,
    micro-batch 4: tokens enough to hide part of the link)."""
    kernels = [{**_cfg(f"{seq // 1024}k {label}", LLAMA, seq,
                       **_k(QLORA, PLAIN, keys, {"memory.activation_checkpointing": seq > 2048})),
                "reference": f"{seq // 1024}k kernels none"}
               for seq in seqs for label, keys in KERNEL_VARIANTS.items()]
    streams = [{**_cfg(f"2k mb4 {label}", LLAMA, 2048, mb=4,
                       **_k(QLORA, PLAIN, keys, {"memory.activation_checkpointing": True})),
                "reference": "2k mb4 weights resident"} for label, keys in STREAM_VARIANTS.items()]
    return kernels + streams


def stage_c_overheads(seqs: tuple[int, ...] = (8192, 32768)) -> list[dict]:
    """Each memory technique vs checkpointing alone, at long context."""
    variants = {"checkpointing alone": PLAIN, "offload cpu": OFFLOAD_CPU, "offload disk": OFFLOAD_DISK,
                "tiled MLP": TILED, "chunked loss": CHUNKED}
    return [_cfg(f"{seq // 1024}k {label}", LLAMA, seq, **_k(QLORA, keys)) for seq in seqs
            for label, keys in variants.items()]
