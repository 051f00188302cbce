"""Recompute inside a decoder layer: norms that keep no fp32 copies, and a sequence-tiled MLP.

Why: with activation checkpointing, the peak of a long-context step is the one layer being recomputed in
backward (see docs/planner.md); the norms' fp32 copies and the MLP's intermediates dominate it.

More in docs/memory.md, "Recompute inside a decoder layer (finetune/memory/layer_recompute.py)".
"""

from __future__ import annotations

import contextlib
import functools

import torch

from finetune.model.family import decoder_layers, dense_mlp, family_of

NORM_TOKENS = 1024


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def recompute_norms(model: torch.nn.Module, tokens: int) -> int:
    """Make every norm inside a decoder layer keep only its input for backward; returns how many."""
    count = 0
    for layer in decoder_layers(model):
        for norm in layer.modules():
            if _is_norm(norm) and not hasattr(norm, "_finetune_tiling"):
                _wrap(norm, tokens, min_chunks=1)
                count += 1
    return count


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device):
    """Replay the random stream of the forward (LoRA dropout masks) without disturbing the caller's."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _chunks_to_run(x: torch.Tensor, n: int) -> range | set[int]:
    """Which of `n` chunks to compute: all, except in the planner's trace on `meta`, the first three and the
    last two.

    Why: tracing cost grows with the number of chunks (128 per norm and MLP at 128k tokens), their memory does
    not vary. Every full chunk has the same shapes, so the same allocations; on `meta` there are no values.
    Forward keeps each chunk's output until the concatenation: the skipped chunks allocate one output block as
    large as theirs where the first of them begins, and the peak (at the last full chunk or the shorter last
    one) is that of the full loop. In
    backward the previous iteration's output and gradients are alive until rebound, the parameters' gradient
    sums exist from the first chunk: iterations 0 and 1 differ, from 2 on the state repeats, so running 0-2
    and the last two gives the full loop's peak (tests/test_plan_speedups.py checks it against the full trace).
    """
    return {0, 1, 2, n - 2, n - 1} if x.is_meta else range(n)


class _Tiled(torch.autograd.Function):
    """y = fn(x) for a position-wise fn, computed in sequence chunks; backward recomputes chunk by chunk.

    The trained parameters of `fn` are inputs, so their gradients are summed over the chunks here and reach
    autograd once (gradient hooks, e.g. layer-wise optimizers, fire once per backward, as without tiling).
    """

    @staticmethod
    def forward(ctx, fn, tokens, x, *params):
        ctx.fn, ctx.tokens = fn, tokens
        ctx.rng = _rng_state(x.device)
        ctx.save_for_backward(x, *params)
        run = _chunks_to_run(x, -(-x.shape[1] // tokens))
        outs: list[torch.Tensor] = []
        done = 0  # chunks produced so far
        with torch.no_grad():
            for i in sorted(run):
                if i > done:  # skipped (full) chunks: one output block as large as theirs, where they begin
                    first = outs[0]
                    outs.append(first.new_empty((first.shape[0], (i - done) * first.shape[1], *first.shape[2:])))
                outs.append(fn(x[:, i * tokens:(i + 1) * tokens]))
                done = i + 1
            return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        grads: list[torch.Tensor | None] = [None] * len(params)
        # Our activation offload's pack hooks are active around backward too: the chunks' own saved tensors
        # are short-lived, keep them where they are (the innermost hooks win).
        keep = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with _restored_rng(ctx.rng, x.device), torch.enable_grad(), keep:
            starts = range(0, x.shape[1], ctx.tokens)
            run = _chunks_to_run(x, len(starts))
            for start in (s for i, s in enumerate(starts) if i in run):
                piece = x[:, start:start + ctx.tokens].detach().requires_grad_(grad_x is not None)
                out = ctx.fn(piece)
                wanted = ([piece] if grad_x is not None else []) + list(params)
                got = list(torch.autograd.grad(out, wanted, grad_out[:, start:start + ctx.tokens], allow_unused=True))
                if grad_x is not None:
                    grad_x[:, start:start + ctx.tokens] = got.pop(0)
                for i, g in enumerate(got):
                    if g is not None:
                        grads[i] = g if grads[i] is None else grads[i].add_(g)
        return (None, None, grad_x, *grads)


def tile_mlps(model: torch.nn.Module, tokens: int) -> int:
    """Run every decoder layer's dense MLP in chunks of `tokens` positions (see module docstring)."""
    count = 0
    family = family_of(model.config)
    for layer in decoder_layers(model):
        # Dense, position-wise MLPs only (LlamaMLP, Lfm2MLP, ...): a mixture-of-experts block routes tokens.
        mlp = dense_mlp(layer, family)
        if mlp is None or hasattr(mlp, "_finetune_tiling"):
            continue
        _wrap(mlp, tokens, min_chunks=2)
        count += 1
    return count


def _wrap(module: torch.nn.Module, tokens: int, min_chunks: int) -> None:
    """Route `module`'s forward through `_Tiled` when grads are needed and the input has >= min_chunks chunks.

    A norm gains from one chunk (its fp32 copies are not kept); an MLP only from two or more. The module's
    class becomes a subclass (not a patched bound forward), so deepcopy and state dicts behave as before.
    """
    cls = type(module)
    if cls not in _TILED_CLASSES:
        _TILED_CLASSES[cls] = type(f"Tiled{cls.__name__}", (cls,), {"forward": _tiled_forward})
    module.__class__ = _TILED_CLASSES[cls]
    module._finetune_tiling = (cls, tokens, min_chunks)


def restore_layers(model: torch.nn.Module) -> int:
    """Undo `apply_layer_recompute`: every tiled norm and MLP gets its plain class back, so a model lent to
    several runs (finetune.train.run.run(base=...)) starts each one as loaded. Returns how many."""
    count = 0
    for module in model.modules():
        tiling = module.__dict__.pop("_finetune_tiling", None)
        if tiling is not None:
            module.__class__ = tiling[0]
            count += 1
    return count


_TILED_CLASSES: dict[type, type] = {}


def _tiled_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    plain_cls, tokens, min_chunks = self._finetune_tiling
    params = [p for p in self.parameters() if p.requires_grad]
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or bool(params))
    if x.dim() < 3 or -(-x.shape[1] // tokens) < min_chunks or not needs_grad:
        return plain_cls.forward(self, x)
    return _Tiled.apply(functools.partial(plain_cls.forward, self), tokens, x, *params)


def apply_layer_recompute(model: torch.nn.Module, norms: bool, mlp_tokens: int | None) -> None:
    """The recipe's `memory.recompute_norms` and `memory.tiled_mlp` (chunk `mlp_tokens`; None = off)."""
    if norms:
        recompute_norms(model, NORM_TOKENS)
    if mlp_tokens:
        tile_mlps(model, mlp_tokens)


def compile_layers(model: torch.nn.Module, enabled: bool) -> int:
    """training.compile: torch.compile each decoder layer in place (`nn.Module.compile`: parameters, hooks and
    state-dict names stay), after the adapter and the layer changes above, so the graph is the trained one.
    Every layer of a family shares one graph (compiled once, at the first step); a graph break falls back to
    eager for that region and is counted (`finetune.compat.graph_breaks`). Returns the number of layers
    compiled."""
    if not enabled:
        return 0
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)
