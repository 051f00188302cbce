"""What fits on each GPU size (the UI's per-size chart, `finetune plan --gpu-memory 8GiB,12GiB,...`) and the
plan's speed as a person should read it: planning questions asked of the planner many times over."""

from __future__ import annotations

from typing import Any

from finetune.plan.context import check_context
from finetune.recipe.load import validate_recipe
from finetune.recipe.schema import Recipe
from finetune.reports import GPUSizes, SizePlans, SpeedEstimate

GPU_SIZES_GB = (8, 12, 16, 24, 48, 80)  # the cards a newcomer is likely to have or rent
CONTEXT_LADDER = tuple(256 << 2 * i for i in range(7))  # 256 .. 1M tokens (the schema's max_seq_len limit)
# Above these the roofline estimate is not believable: per-step overheads it leaves out dominate small models.
SPEED_CEILING = {"cuda": 100_000, "cpu": 10_000}


def plan_gpu_sizes(recipe: Recipe, sizes_gb: tuple[float, ...] = GPU_SIZES_GB,
                   ladder: tuple[int, ...] = CONTEXT_LADDER) -> GPUSizes:
    """What fits on each GPU size (GiB; 22.35 for a 24GB card): the longest context it trains (the recipe's
    other settings kept, its `auto` ones chosen by the planner; at most the model's max_position_embeddings)
    and the largest micro-batch at the recipe's max_seq_len.

    One leanest-plan query per sequence length (the smallest memory any allowed configuration needs) answers
    every size at once; the model config is read once and the planner's trace cache keeps repeats cheap.
    Between two lengths of the ladder the boundary is interpolated and the interpolated length checked by
    the planner, so every reported length is one the planner says fits. Returns `sizes` (one row per GPU:
    gpu_gb, longest_context, largest_micro_batch, recipe_fits), the bytes needed per length and micro-batch, and
    `micro_batch_cap`, the largest micro-batch the search tries (a row at the cap may fit more)."""
    from finetune.plan import predict
    from finetune.plan.search import MICRO_BATCHES
    from finetune.plan.trace import planned_config
    from finetune.recipe.init_from import resolve_init_from

    recipe = resolve_init_from(recipe)  # the adapter's shape written out: the copies below set every key
    config = planned_config(recipe.model.path, recipe.model.trust_remote_code)
    margin = recipe.memory.gpu_memory_margin
    cache: dict[tuple[str, int], int] = {}

    def need(key: str, value: int) -> int:
        """Total GPU memory (margin included) the leanest configuration needs with `key` set to `value`."""
        if (key, value) not in cache:
            data = recipe.model_dump(mode="python")
            if key == "seq":  # the longest context is that of one sequence per micro-batch
                data["data"]["max_seq_len"] = value
                if data["training"]["micro_batch_size"] == "auto":
                    data["training"].update(micro_batch_size=1, gradient_accumulation_steps=1,
                                            effective_batch_size=None)
            else:
                data["training"].update(micro_batch_size=value, gradient_accumulation_steps=1,
                                        effective_batch_size=None)
            plan = predict(validate_recipe(data, "plan_gpu_sizes"), model_config=config, gpu_memory=margin + 1,
                           device="cuda", full_length=True)  # contexts of max_seq_len, whatever the images
            # Only configurations traced and rejected for the budget alone count (an offload that would not find
            # enough free RAM or disk does not make a length trainable; a lower bound is no peak); without one,
            # the planner's own minimum.
            over = [c.peak_bytes for c in plan.rejected if c.kind == "over_budget"]
            cache[key, value] = min(over) + margin if over else plan.min_budget_bytes or plan.peak_bytes + margin
        return cache[key, value]

    largest = round(max(sizes_gb) * 2**30)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None) or max(ladder)  # no use training past it
    context_need = {}
    for seq in sorted({s for s in ladder if s < limit} | {min(limit, max(ladder))}):
        context_need[seq] = need("seq", seq)
        if context_need[seq] > largest:
            break
    batch_need = {}
    for mb in MICRO_BATCHES:
        batch_need[mb] = need("mb", mb)
        if batch_need[mb] > largest:
            break
    rows = []
    for gb in sizes_gb:
        total = round(gb * 2**30)
        fit = [s for s, n in context_need.items() if n <= total]
        longest = max(fit) if fit else None
        above = [s for s in context_need if longest is not None and s > longest]
        if above:  # between two ladder points: interpolate, then ask the planner
            lo, hi = context_need[longest], context_need[above[0]]
            guess = longest + int((above[0] - longest) * (total - lo) / max(hi - lo, 1)) // 256 * 256
            for tried in (guess, (longest + guess) // 512 * 256):  # and once more halfway, if that was too long
                if tried > longest and need("seq", tried) <= total:
                    longest = tried
                    break
        batches = [mb for mb, n in batch_need.items() if n <= total]
        rows.append({"gpu_gb": gb, "longest_context": longest, "largest_micro_batch": max(batches) if batches else None,
                     "recipe_fits": need("seq", recipe.data.max_seq_len) <= total})
    return {"max_seq_len": recipe.data.max_seq_len, "model_max_context": limit, "sizes": rows,
            "context_need_bytes": {s: n for (k, s), n in sorted(cache.items()) if k == "seq"},
            "micro_batch_need_bytes": batch_need, "micro_batch_cap": max(MICRO_BATCHES)}


def plan_sizes(recipe: Recipe, sizes: list[str]) -> SizePlans:
    """`finetune plan --gpu-memory 8GiB,12GiB,...`: the plan for each GPU size (`sizes` as --gpu-memory spells
    them), beside what `plan_gpu_sizes` (the UI's per-size chart) says of it: the longest context at micro-batch
    1 and the largest micro-batch at max_seq_len, up to the search's cap (`micro_batch_cap`)."""
    from finetune.plan import predict
    from finetune.plan.search import MICRO_BATCHES
    from finetune.units import parse_bytes

    totals = [int(parse_bytes(size)) for size in sizes]
    sweep = plan_gpu_sizes(recipe, tuple(total / 2**30 for total in totals))
    rows = []
    for size, total, swept in zip(sizes, totals, sweep["sizes"], strict=True):
        check_context(recipe)
        chosen = predict(recipe, gpu_memory=total, device="cuda")
        rows.append({"gpu_memory": size, "gpu_bytes": total, "fits": chosen.fits, "peak_bytes": chosen.peak_bytes,
                     "settings": chosen.settings, "tokens_per_s": chosen.tokens_per_s,
                     "min_budget_bytes": chosen.min_budget_bytes, "longest_context": swept["longest_context"],
                     "largest_micro_batch": swept["largest_micro_batch"]})
    return {"max_seq_len": recipe.data.max_seq_len, "model_max_context": sweep["model_max_context"],
            "micro_batch_cap": max(MICRO_BATCHES), "sizes": rows}


def speed_estimate(plan: dict[str, Any]) -> SpeedEstimate:
    """The plan's predicted tokens/s as a person should read it: rounded to two figures, with the hardware
    figures it rests on, and capped where a roofline estimate stops being believable (`text`, `short` for a
    table cell, `basis`, `tokens_per_s`: the rounded figure or None)."""
    from finetune.plan.cost_model import DEVICE, DEVICE_BASIS

    device = plan.get("device") or "cuda"
    figures = plan.get("device_figures") or DEVICE.get(device, DEVICE["cuda"])
    flops = f"{figures['flops'] / 1e12:.1f} TFLOP/s" if figures["flops"] >= 1e12 else \
        f"{figures['flops'] / 1e9:,.0f} GFLOP/s"
    if plan.get("figures_measured"):
        whose, caveat = "measured on this machine's CPU", ""
    else:
        whose, caveat = f"of {DEVICE_BASIS.get(device, device)}", "whatever the card's memory size; "
    basis = (f"roofline model with the figures {whose} ({flops}, {figures['mem_bw'] / 1e9:,.0f} GB/s), {caveat}"
             "real runs are usually slower")
    tps = plan.get("tokens_per_s")
    if not isinstance(tps, (int, float)) or tps <= 0:
        return {"tokens_per_s": None, "text": "no speed estimate", "short": "", "basis": basis}
    ceiling = SPEED_CEILING.get(device, SPEED_CEILING["cuda"])
    if tps > ceiling:
        return {"tokens_per_s": None, "basis": basis, "short": f"over {ceiling:,}",
                "text": f"over {ceiling:,} tokens/s (too small a model for the estimate: per-step overheads, "
                        "which it leaves out, decide the speed)"}
    rounded = float(f"{tps:.2g}")
    return {"tokens_per_s": rounded, "text": f"about {rounded:,.0f} tokens/s", "short": f"~{rounded:,.0f}",
            "basis": basis}
