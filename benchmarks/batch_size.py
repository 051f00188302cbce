"""The batch-size engine on real text: the online noise scale vs brute force, and fixed batches vs `auto`.

    nice -n 10 python benchmarks/batch_size.py --quick      # ~15 min on the busy shared 2-core machine
    nice -n 10 python benchmarks/batch_size.py              # the full run: ~30 min there (1,640 s fixed + auto)
    nice -n 10 python benchmarks/batch_size.py --only fixed # (a) and the fixed batches, cached, no report

Model: a small Llama trained from scratch on /work/shared/datasets/c4_demo.jsonl (pre-training-like, where
the critical batch matters most): hidden 128, 2 layers, BPE vocabulary of 2048 trained on the same text,
sequences of 64 tokens packed from the documents; 10% of the sequences are held out. fp32, CPU, 1 thread.

(a) The online estimate (finetune.train.noise_scale: GradNormProbe hooks + NoiseScaleEMA, micro-batches of
    4 sequences accumulated 4 at a time) against a brute-force one at the same frozen weights: gradients of
    many independent batches of 4 sequences, tr(Sigma) from their spread and |G|^2 from their mean with the
    bias removed. Taken after a short warm-up training so the weights are not at initialisation.
(b) Held-out loss against tokens for fixed batches of 1, 4, 16 and 64 sequences (AdamW, learning rates a
    factor 2 apart around the square-root rule, 3 per batch plus one more beyond an edge while the best is at
    that edge, at most MAX_EXTEND; beta2 by the rule from 0.99 at 16; linear warmup 5% and decay to 0 over the
    same token budget) and for `auto` with no tuning (lr(ref) = the middle one of batch 16): auto_run mirrors
    the BatchEngine policy (finetune/train/batch_engine.py) step for step - the batch-size warmup first (updates
    of 1 sequence within each loader batch, the update batch from finetune.recipe.batch_rules.update_batch, up
    to the micro-batch), then no accumulation to start, the noise scale from the probe (a split every SPLIT_EVERY loader batches, or at micro-batch 1 a pair of loader
    batches in one update), forward-backward and update timed, the accumulation from
    finetune.recipe.batch_rules.best_accumulation, learning rate and beta2 from the rules - at the planner's
    fastest micro-batch on this machine (32) and at 4 and 1. The same sequences in the same order for every run.
    The loops drive the engine's functions directly (no training loop) so the runs fit the time;
    tests/test_batch_engine.py checks the loop integration. The fitted critical batch: the tokens each
    batch's best curve needs to reach a common loss, E(B) = E_min (1 + B / B_crit).

    The fixed runs and (a) do not depend on the auto rule: each is cached as JSON under
    benchmarks/results/batch_size[-quick]-cache/ (keyed by its settings), so `--only fixed` can run them ahead
    and `--only auto` (or a plain rerun) only runs what is missing plus the auto rows.

Writes benchmarks/results/batch_size[-quick].txt and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.recipe.batch_rules import (  # noqa: E402
    MAX_ACCUMULATION,
    StepTimes,
    best_accumulation,
    scale_for_batch,
    update_batch,
)
from finetune.recipe.schema import TrainingConfig  # noqa: E402
from finetune.train.batch_engine import MIN_OBSERVATIONS  # noqa: E402
from finetune.train.noise_scale import GradNormProbe, NoiseScaleEMA  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "c4_demo.jsonl"  # ../shared beside the checkout
RESULTS = Path(__file__).resolve().parent / "results"
SEQ, VOCAB, REF_BATCH, REF_BETA2, REF_LR = 64, 2048, 16, 0.99, 3e-3
BATCHES = (1, 4, 16, 64)
MAX_EXTEND = 2  # extra learning rates per batch when the best of the 3 is at an edge
# auto at the planner's fastest fit here (its speed model, utilisation tokens / (tokens + 1024) and no per-step
# cost, rises with the micro-batch and everything fits in RAM: the largest it searches, 32), and at 4 and 1
SPLIT_EVERY = TrainingConfig.model_fields["noise_scale_split_every"].default  # as the loop splits
AUTO_MICROS = (32, 4, 1)


def build_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and held-out sequences of SEQ tokens packed from c4_demo, tokenised by a BPE trained on it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [json.loads(line)["text"] for line in DATA.read_text().splitlines() if line.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    eos = tok.token_to_id("<eos>")
    ids = [t for enc in tok.encode_batch(texts) for t in (*enc.ids, eos)]
    seqs = torch.tensor(ids[: len(ids) // SEQ * SEQ]).view(-1, SEQ)
    seqs = seqs[torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed))]
    held = len(seqs) // 10
    return seqs[held:], seqs[:held]


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def loss_sum(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token loss of `batch` and its token count (every position but the first has a label)."""
    logits = model(input_ids=batch).logits[:, :-1].float()
    target = batch[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="sum"), \
        target.numel()


@torch.no_grad()
def held_out(model: torch.nn.Module, seqs: torch.Tensor) -> float:
    model.eval()
    total, count = 0.0, 0
    for part in seqs.split(64):
        s, n = loss_sum(model, part)
        total, count = total + float(s), count + n
    model.train()
    return total / count


# -- (a) online vs brute force -------------------------------------------------------------------------
def compare_estimates(train: torch.Tensor, warmup_steps: int, online_steps: int, brute_batches: int) -> dict:
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=REF_LR, betas=(0.9, REF_BETA2))
    for i in range(warmup_steps):  # move off the initialisation
        s, n = loss_sum(model, train[i * 16:(i + 1) * 16])
        (s / n).backward()
        opt.step()
        opt.zero_grad()
    params = [p for p in model.parameters() if p.requires_grad]
    pool = train[warmup_steps * 16:]
    gen = torch.Generator().manual_seed(1)

    probe, ema = GradNormProbe(params), NoiseScaleEMA(decay=1 - 1 / online_steps)
    t0 = time.time()
    for _ in range(online_steps):  # the run's own estimator: 4 micro-batches of 4 sequences per step
        idx = torch.randint(len(pool), (16,), generator=gen)
        parts = [pool[idx[j:j + 4]] for j in range(0, 16, 4)]
        total = 16 * (SEQ - 1)
        for part in parts:
            probe.micro_batch(part.numel() - len(part), (part.numel() - len(part)) / total)
            s, _ = loss_sum(model, part)
            (s / total).backward()
        ema.update(probe.finish())
        model.zero_grad(set_to_none=True)
    online_s = time.time() - t0
    probe.remove()
    online = ema.values()

    grads = []
    for _ in range(brute_batches):  # independent batches of 4 sequences, each gradient kept (flattened)
        idx = torch.randint(len(pool), (4,), generator=gen)
        s, n = loss_sum(model, pool[idx])
        (s / n).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        model.zero_grad(set_to_none=True)
    g = torch.stack(grads).double()
    b = 4 * (SEQ - 1)  # tokens per batch
    mean = g.mean(0)
    trace = b * (g - mean).square().sum(1).mean() * len(g) / (len(g) - 1)  # tr(Sigma) per token
    grad_sq = mean.square().sum() - trace / (b * len(g))  # |mean|^2 is biased up by tr(Sigma) / (b n)
    brute = {"gns": float(trace / grad_sq), "grad_sq": float(grad_sq), "trace_sigma": float(trace)}
    return {"online": online, "brute": brute, "online_steps": online_steps, "brute_batches": brute_batches,
            "online_seconds": round(online_s, 1)}


# -- (b) fixed batches vs auto ------------------------------------------------------------------------
def lr_at(step_tokens: int, total_tokens: int, peak: float) -> float:
    """Linear warmup over the first 5% of the tokens, then linear decay to 0 at the end (in tokens)."""
    warm = 0.05 * total_tokens
    return peak * (step_tokens / warm if step_tokens < warm else max(0.0, (total_tokens - step_tokens) / (total_tokens - warm)))


def train_run(train: torch.Tensor, evals: torch.Tensor, total_seqs: int, eval_every: int, *, batch: int,
              lr: float) -> list[tuple[int, float]]:
    """A fixed batch: train on the first total_seqs sequences at lr(ref) `lr` scaled to `batch` by the rules.
    Returns (tokens, held-out loss) points."""
    model = build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    micro = min(batch, 16)
    accumulation = batch // micro
    rule = scale_for_batch(lr, (0.9, REF_BETA2), "adamw", REF_BATCH, micro * accumulation)
    opt = torch.optim.AdamW(params, lr=rule.new_learning_rate, betas=rule.new_betas)
    seen, points, next_eval = 0, [], 0
    total_tokens = total_seqs * (SEQ - 1)
    while seen < total_seqs:
        if seen >= next_eval:
            points.append((seen * (SEQ - 1), held_out(model, evals)))
            next_eval += eval_every
        parts = []
        for _ in range(accumulation):
            if seen >= total_seqs:
                break
            parts.append(train[seen:seen + micro])
            seen += len(parts[-1])
        tokens = sum(p.numel() - len(p) for p in parts)
        for part in parts:
            s, _ = loss_sum(model, part)
            (s / tokens).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(seen * (SEQ - 1), total_tokens, rule.new_learning_rate)
        opt.step()
        opt.zero_grad(set_to_none=True)
    points.append((seen * (SEQ - 1), held_out(model, evals)))
    return points


def auto_run(train: torch.Tensor, evals: torch.Tensor, total_seqs: int, eval_every: int, *, micro: int, lr: float,
             log: list, times: StepTimes) -> list[tuple[int, float]]:
    """`effective_batch_size: auto` at micro-batch `micro`, as the BatchEngine policy runs it: the warmup first
    (finetune/train/sub_updates.py): updates of u = 1 sequence, each loader batch of `micro` run as micro/u
    updates (two chunks in one update every SPLIT_EVERY updates, for the noise scale), not timed, u from
    batch_rules.update_batch after MIN_OBSERVATIONS fresh observations, until it is `micro`; then no
    accumulation to start; the noise scale from the probe (a loader batch split in two every SPLIT_EVERY, or
    at micro-batch 1 a pair of loader batches in one update every SPLIT_EVERY); forward-backward and the rest
    of each step timed into `times`; after MIN_OBSERVATIONS fresh observations, the accumulation from
    batch_rules.best_accumulation, the learning rate (lr(ref) `lr`, untuned) and beta2 from the rules for
    u x accumulation sequences."""
    model = build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    u = 1
    rule = scale_for_batch(lr, (0.9, REF_BETA2), "adamw", REF_BATCH, u)
    opt = torch.optim.AdamW(params, lr=rule.new_learning_rate, betas=rule.new_betas)
    peak = rule.new_learning_rate
    probe, ema = GradNormProbe(params), NoiseScaleEMA()
    accumulation, loader_batches, seen, points, next_eval, observed_at_change = 1, 0, 0, [], 0, 0
    since_pair = 0  # updates since the warmup's last measuring pair of chunks
    total_tokens = total_seqs * (SEQ - 1)

    def update() -> None:  # the update after its backwards, as the loop makes it
        obs = probe.finish()
        if obs is not None:
            ema.update(obs)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(seen * (SEQ - 1), total_tokens, peak)
        opt.step()
        opt.zero_grad(set_to_none=True)

    while seen < total_seqs:
        if seen >= next_eval:
            points.append((seen * (SEQ - 1), held_out(model, evals)))
            next_eval += eval_every
        if u < micro:  # the warmup: one loader batch as updates of u sequences
            chunks = list(train[seen:seen + micro].split(u))
            seen += sum(len(c) for c in chunks)
            loader_batches += 1
            i = 0
            while i < len(chunks):
                pair = since_pair >= SPLIT_EVERY - 1 and i + 1 < len(chunks)
                take = 2 if pair else 1
                group, since_pair, i = chunks[i:i + take], 0 if pair else since_pair + 1, i + take
                tokens = sum(c.numel() - len(c) for c in group)
                for chunk in group:
                    n = chunk.numel() - len(chunk)
                    probe.micro_batch(n, n / tokens)
                    s, _ = loss_sum(model, chunk)
                    (s / tokens).backward()
                update()
            if ema.steps - observed_at_change >= MIN_OBSERVATIONS:
                values = ema.values() or {}
                new = update_batch(values.get("gns"), SEQ - 1, u, micro)
                if new != u:
                    u, observed_at_change = new, ema.steps
                    rule = scale_for_batch(lr, (0.9, REF_BETA2), "adamw", REF_BATCH, u)
                    peak = rule.new_learning_rate
                    for g in opt.param_groups:
                        g["betas"] = rule.new_betas
                    log.append({"tokens": seen * (SEQ - 1), "batch": u, "update_batch": u,
                                "gns": round(values["gns"]), "lr": round(peak, 6), "beta2": round(rule.new_betas[1], 6)})
            continue
        pair = accumulation == 1 and micro == 1 and loader_batches // SPLIT_EVERY != (loader_batches + 2) // SPLIT_EVERY
        group = []
        for _ in range(2 if pair else accumulation):
            if seen >= total_seqs:
                break
            group.append(train[seen:seen + micro])
            seen += len(group[-1])
        tokens = sum(p.numel() - len(p) for p in group)
        forward_backward = []
        for i, batch in enumerate(group):
            t0 = time.perf_counter()
            split = i == 0 and len(group) == 1 and len(batch) > 1 and (loader_batches + 1) % SPLIT_EVERY == 0
            for part in (batch[: len(batch) // 2], batch[len(batch) // 2:]) if split else (batch,):
                n = part.numel() - len(part)
                probe.micro_batch(n, n / tokens)
                s, _ = loss_sum(model, part)
                (s / tokens).backward()
            forward_backward.append(time.perf_counter() - t0)
            loader_batches += 1
        t0 = time.perf_counter()
        update()
        rest = time.perf_counter() - t0
        for fb in forward_backward[:-1]:
            times.add(fb, 0.0, updated=False)
        times.add(forward_backward[-1], rest, updated=True)
        if ema.steps - observed_at_change >= MIN_OBSERVATIONS:
            values = ema.values() or {}
            new = best_accumulation(values.get("gns"), micro * (SEQ - 1), *(times.estimate() or (None, None)),
                                    current=accumulation, limit=MAX_ACCUMULATION)
            if new != accumulation:
                accumulation, observed_at_change = new, ema.steps
                rule = scale_for_batch(lr, (0.9, REF_BETA2), "adamw", REF_BATCH, micro * accumulation)
                peak = rule.new_learning_rate
                for g in opt.param_groups:
                    g["betas"] = rule.new_betas
                t_micro, t_opt = times.estimate()
                log.append({"tokens": seen * (SEQ - 1), "batch": micro * accumulation, "gns": round(values["gns"]),
                            "t_micro_ms": round(1000 * t_micro, 2), "t_opt_ms": round(1000 * t_opt, 2),
                            "lr": round(peak, 6), "beta2": round(rule.new_betas[1], 6)})
    points.append((seen * (SEQ - 1), held_out(model, evals)))
    log.append({"final_gns": (ema.values() or {}).get("gns")})
    probe.remove()
    return points


CACHE_VERSION = 1  # bump when train_run's fixed-batch path or the data/model change


def _cached(path: Path, key: dict, compute):
    """compute() once per key: fixed-batch runs and the estimate comparison do not depend on the auto rule,
    so they are kept as JSON (benchmarks/results/batch_size[-quick]-cache/) and reused by later invocations."""
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["value"]
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "value": value}, indent=1))
    tmp.replace(path)
    return value


def sweep(batch: int, run_one) -> tuple[dict[float, float], list[str]]:
    """Final held-out loss per lr(ref) for `batch`: 3 points a factor 2 apart around REF_LR, then, while the
    best is at an edge, one more point beyond that edge (at most MAX_EXTEND), so the optimum is bracketed."""
    losses = {REF_LR * f: run_one(REF_LR * f) for f in (0.5, 1.0, 2.0)}
    notes = []
    for _ in range(MAX_EXTEND):
        best = min(losses, key=losses.get)
        lrs = sorted(losses)
        if best not in (lrs[0], lrs[-1]):
            break
        new = best * 2 if best == lrs[-1] else best / 2
        notes.append(f"optimum at the {'top' if best == lrs[-1] else 'bottom'} edge ({best:.3g}): added {new:.3g}")
        losses[new] = run_one(new)
    best = min(losses, key=losses.get)
    if best in (min(losses), max(losses)):
        notes.append(f"still at an edge after {MAX_EXTEND} extensions: NOT bracketed")
    return losses, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and estimates (~10 min)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=("fixed", "auto"), help="fixed: (a) and the fixed-batch sweep only "
                        "(cached, no report); auto: the auto rows, reading (a) and the fixed runs from the cache "
                        "(running what is missing)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quick = args.quick
    stem = "batch_size-quick" if quick else "batch_size"
    cache = RESULTS / f"{stem}-cache"
    total_seqs = 1024 if quick else 2560
    n_evals = 128 if quick else 256
    start = time.time()
    train, evals = build_data()
    evals = evals[:n_evals]
    print(f"data: {len(train)} train / {len(evals)} held-out sequences of {SEQ} tokens", flush=True)
    base_key = {"version": CACHE_VERSION, "total_seqs": total_seqs, "evals": n_evals, "seq": SEQ, "vocab": VOCAB,
                "ref_batch": REF_BATCH, "ref_beta2": REF_BETA2, "threads": args.threads}

    def estimates() -> dict:
        t0 = time.time()
        out = compare_estimates(train, warmup_steps=20, online_steps=150 if quick else 400,
                                brute_batches=300 if quick else 800)
        print(f"(a) online gns {out['online']['gns']:.4g} vs brute force {out['brute']['gns']:.4g} tokens", flush=True)
        return {**out, "seconds": round(time.time() - t0, 1)}

    est = _cached(cache / "estimates.json", base_key, estimates)
    ratio = est["online"]["gns"] / est["brute"]["gns"]

    curves, best, notes, seconds = {}, {}, {}, {}
    for batch in BATCHES:
        def run_one(lr: float, batch: int = batch) -> float:
            def compute() -> dict:
                t0 = time.time()
                points = train_run(train, evals, total_seqs, total_seqs // 8, batch=batch, lr=lr)
                print(f"(b) batch {batch:3d} lr(ref) {lr:.3g}: held-out {points[-1][1]:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                return {"points": points, "seconds": round(time.time() - t0, 1)}

            value = _cached(cache / f"B{batch}-lr{lr:.6g}.json", {**base_key, "batch": batch, "lr": lr}, compute)
            curves[f"B={batch} lr={lr:.3g}"] = value["points"]
            seconds[f"B={batch} lr={lr:.3g}"] = value["seconds"]
            return value["points"][-1][1]

        losses, notes[batch] = sweep(batch, run_one)
        lr = min(losses, key=losses.get)
        best[batch] = (f"B={batch} lr={lr:.3g}", losses[lr])
    if args.only == "fixed":
        print(f"fixed runs done ({time.time() - start:.0f}s); cache in {cache}")
        return
    ramps: dict[str, list] = {}
    timing: dict[str, tuple[float, float] | None] = {}
    for micro in AUTO_MICROS:
        t0 = time.time()
        name = f"auto mb={micro}"
        ramps[name], times = [], StepTimes()
        curves[name] = points = auto_run(train, evals, total_seqs, total_seqs // 8, micro=micro, lr=REF_LR,
                                         log=ramps[name], times=times)
        seconds[name], timing[name] = round(time.time() - t0, 1), times.estimate()
        print(f"(b) {name}: held-out {points[-1][1]:.4f} ({time.time() - t0:.0f}s); ramp {ramps[name]}", flush=True)

    best_fixed = min(best.values(), key=lambda v: v[1])
    lines = [
        f"benchmarks/batch_size.py{' --quick' if quick else ''}: tiny Llama (hidden 128, 2 layers, vocab {VOCAB}) "
        f"from scratch on c4_demo, {SEQ}-token sequences, {total_seqs} training sequences "
        f"({total_seqs * (SEQ - 1):,} labelled tokens), {len(evals)} held out; CPU, {args.threads} thread(s); "
        f"{time.time() - start:.0f}s this invocation; the runs took {sum(seconds.values()) + est.get('seconds', 0):.0f}s "
        f"in all (fixed runs and (a) may come from the cache; wall times on a shared machine)",
        "",
        "(a) noise scale at frozen weights (after 20 warm-up steps), in labelled tokens",
        f"  online (hooks, 4 x 4 sequences per step, {est['online_steps']} steps): gns {est['online']['gns']:.4g}  "
        f"|G|^2 {est['online']['grad_sq']:.4g}  tr(Sigma) {est['online']['trace_sigma']:.4g}",
        f"  brute force ({est['brute_batches']} independent batches of 4): gns {est['brute']['gns']:.4g}  "
        f"|G|^2 {est['brute']['grad_sq']:.4g}  tr(Sigma) {est['brute']['trace_sigma']:.4g}",
        f"  ratio online / brute force: {ratio:.3f}  ({'within' if abs(ratio - 1) <= 0.25 else 'NOT within'} 25%)",
        "",
        "(b) final held-out loss at equal tokens (lr(ref) is the learning rate at batch 16; each batch's own is",
        "    lr(ref) x sqrt(B/16), beta2 = 0.99 ** (B/16))",
    ]
    for batch in BATCHES:
        for name, points in sorted(((n, p) for n, p in curves.items() if n.startswith(f"B={batch} ")),
                                   key=lambda item: float(item[0].split("lr=")[1])):
            lines.append(f"  {name:18s} {points[-1][1]:.4f}   ({seconds[name]:.0f}s)")
        lines += [f"    sweep: {note}" for note in notes[batch]]
    lines.append(f"  best fixed: {best_fixed[0]} {best_fixed[1]:.4f}")
    lines += critical_batch({b: curves[name] for b, (name, _) in best.items()})
    for name in ramps:
        gap = curves[name][-1][1] / best_fixed[1] - 1
        changes = [r for r in ramps[name] if "batch" in r]
        none = ("none (k* rounds to 1: the optimizer step is too cheap to pay for tokens)" if name == "auto mb=1"
                else "none (the warmup kept updates of 1 sequence: 2 would cost more than the token slack)")
        t = timing[name]
        lines += [f"  {name:18s} {curves[name][-1][1]:.4f}   ({seconds[name]:.0f}s)  {100 * gap:+.2f}% vs best fixed "
                  f"({'within' if gap <= 0.02 else 'NOT within'} 2%)",
                  (f"    measured: t_micro {1000 * t[0]:.3g} ms, t_opt {1000 * t[1]:.3g} ms (medians), final gns "
                   + (f"{gns:.4g} tokens" if (gns := ramps[name][-1]["final_gns"]) else "not measured (too few "
                      "observations)")) if t else "    measured: no step times",
                  f"    batch changes: {changes or none}"]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.txt").write_text(text)
    plot(curves, {name for name, _ in best.values()}, est, RESULTS / f"{stem}.png")


def critical_batch(best_curves: dict[int, list]) -> list[str]:
    """Report lines: labelled tokens each batch's best curve needs to reach the loss the worst of them ends at
    (linear between evaluations), and the critical batch that fits E(B) = E_min (1 + B / B_crit) to them
    (least squares, E linear in B) - the token price of a batch the auto rule takes from the noise scale."""
    target = max(points[-1][1] for points in best_curves.values())
    reached = {}
    for batch, points in best_curves.items():
        for (t0, l0), (t1, l1) in zip(points, points[1:], strict=False):
            if l1 <= target:
                reached[batch] = t0 + (t1 - t0) * (l0 - target) / (l0 - l1) if l0 > target else t0
                break
    xs, ys = list(reached), list(reached.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    fit = (f"B_crit = E_min / slope = {intercept / slope:.3g} sequences = {intercept / slope * (SEQ - 1):.4g} tokens"
           if slope > 0 and intercept > 0 else f"no positive fit (E_min {intercept:.4g}, slope {slope:.4g})")
    return [f"  tokens to reach {target:.4f} (the worst best-lr final loss): "
            + ", ".join(f"B={b} {t:,.0f}" for b, t in reached.items()),
            f"    E(B) = E_min (1 + B / B_crit) fitted to them: {fit}"]


def plot(curves: dict, best: set[str], est: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    styles = ("-", "--", ":")
    for name, points in curves.items():  # each batch's best learning rate bold, the rest of its sweep thin
        if name.startswith("auto"):
            style = dict(color="black", linewidth=2, linestyle=styles[AUTO_MICROS.index(int(name.split("=")[1]))])
        else:
            batch = int(name.split()[0][2:])
            style = dict(color=f"C{BATCHES.index(batch)}", linewidth=2 if name in best else 0.8,
                         alpha=1.0 if name in best else 0.4)
        ax.plot([t for t, _ in points], [v for _, v in points], label=name, **style)
    ax.set_xlabel("labelled tokens")
    ax.set_ylabel("held-out loss")
    ax.set_ylim(top=min(max(v for pts in curves.values() for _, v in pts[1:]) + 0.2, 8.0))
    ax.set_title(f"batch size on c4_demo; gns online {est['online']['gns']:.3g} vs brute force "
                 f"{est['brute']['gns']:.3g} tokens")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
