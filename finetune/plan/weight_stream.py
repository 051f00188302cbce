"""The planner's price of weight streaming (`memory.offload_weights`, finetune.memory.weight_store): device
memory, host RAM and disk, and the time of the link against the compute it hides behind.

Memory: the device holds `ahead + 1` decoder layers' frozen weights (as stored: 4-bit with their quant state,
or 16-bit; a MoE layer's experts too) instead of all of them; the embeddings, the LM head and everything
trained stay. The cpu tier holds every layer's in host RAM (pinned on CUDA); the disk tier holds them in files
under memory.offload_dir, read through `ahead + 1` layers' pinned buffers on CUDA.

Time: every micro-batch brings each layer over the link twice (forward; backward, where a checkpointed
layer's recompute uses the same fetch). A layer's transfer overlaps the compute of the one before it, so the
link costs only what exceeds the compute: max(0, 2 x streamed bytes x seconds per byte - compute) per
micro-batch. Where the link is slower the step is link-bound, and a larger micro-batch (more compute per byte)
hides it: the tokens/s the search ranks by say so, and `bound_note` says which bounds the chosen plan.

Read-ahead depth (memory.offload_weights_ahead, searched): the disk tier on a GPU carries a layer over two
links in series (the SSD into a pinned buffer on the reader thread, then the buffer to the GPU on the copy
stream). With one layer ahead the two add up (the reader starts the next layer when this one is needed); with
two or more the reader reads one layer while the previous one crosses PCIe, so the slower link alone counts.
Over one link (the cpu tier; a CPU run) a deeper read-ahead buys no time for layers of equal size, only memory
(one layer's window more), so the search tries a second layer ahead only for the disk tier on a GPU
(`AHEAD_CHOICES`) and takes it where it fits and is faster.

Resident layers (memory.offload_weights_resident): the first layers' weights stay on the device, each priced as
one layer's weights there and carrying nothing over the link. Not a search axis (any count up to the layers
could be): the search's chosen plan keeps as many as its budget has room for where that is faster (a link-bound
step), none where the link is hidden (plan.search's `_fill_resident`).
"""

from __future__ import annotations

from dataclasses import replace

from finetune.plan.memory_model import (
    ModelSpec,
    expert_weight_bytes,
    experts_offloaded,
    streamed_weight_bytes,
    weights_streamed,
)
from finetune.recipe.offload_tiers import STORES
from finetune.recipe.settings import Settings
from finetune.units import format_bytes

FETCHES_PER_MICRO_BATCH = 2  # forward, and backward (with a checkpointed layer's recompute)
# The slowest disk weight streaming reads from: below it (a network mount, a USB stick, a busy hard disk) each
# micro-batch of a 70B waits over ten minutes for the link. A recipe naming the disk tier on such a disk is
# refused (`slow_disk`); `auto` never picks it.
MIN_DISK_BYTES_PER_S = 100e6


AHEAD_CHOICES = (1, 2)  # read-ahead depths the search tries where the links are in series (module docstring)


def ahead_choices(tier: str, device: str) -> tuple[int, ...]:
    """The read-ahead depths `memory.offload_weights_ahead: auto` may take with weight streaming from `tier`:
    deeper than one only where it can be faster (two links in series: the disk tier on a GPU)."""
    return AHEAD_CHOICES if tier == "disk" and device == "cuda" else AHEAD_CHOICES[:1]


def link_seconds(spec: ModelSpec, settings: Settings, links: tuple[float, ...]) -> float:
    """Seconds the links take to carry one micro-batch's streamed weights (0 without streaming). `links`: the
    bytes/s of each link a streamed layer crosses, in order (the disk, then PCIe, for the disk tier on a GPU):
    they add up with one layer read ahead, the slowest alone counts with more (module docstring)."""
    if not weights_streamed(spec, settings):
        return 0.0
    per_byte = sum(1 / bw for bw in links) if settings.offload_weights_ahead == 1 else max(1 / bw for bw in links)
    return FETCHES_PER_MICRO_BATCH * streamed_weight_bytes(spec, settings)[0] * per_byte


def _offloaded(spec: ModelSpec, settings: Settings) -> tuple[str, str, float, float, int] | None:
    """The weight store's use in `settings`: (its words in messages, tier, bytes it holds, one layer's, layers
    read ahead): weight streaming (every frozen weight) or expert offload (the experts); None for neither."""
    if weights_streamed(spec, settings):
        return (f"weight streaming from {settings.offload_weights}", settings.offload_weights,
                *streamed_weight_bytes(spec, settings), settings.offload_weights_ahead)
    if experts_offloaded(spec, settings):
        return (f"expert offload to {settings.offload_experts}", settings.offload_experts,
                *expert_weight_bytes(spec, settings), 1)
    return None


def host_bytes(spec: ModelSpec, settings: Settings) -> tuple[int, int]:
    """(host RAM, disk) bytes the weight store holds (weight streaming, or expert offload): every layer's in RAM
    for cpu; files plus `ahead + 1` layers' pinned read buffers (on CUDA) for disk."""
    used = _offloaded(spec, settings)
    if used is None:
        return 0, 0
    _, tier, held, per_layer, ahead = used
    if tier == "cpu":
        return int(held), 0
    return (int((ahead + 1) * per_layer) if spec.device == "cuda" else 0), int(held)


def lacking_room(spec: ModelSpec, settings: Settings, free: dict[str, int],
                 activations_on_disk: int) -> tuple[str, str] | None:
    """(the rejection's kind, its reason) where the weight store's tier (weight streaming's or expert
    offload's) lacks the room, else None: host RAM (free, capped by memory.offload_cpu_limit) on a GPU,
    offload_dir's free space with the activations the disk tier holds there and the run's margin."""
    from finetune.memory.offload_disk import with_margin

    used = _offloaded(spec, settings)
    if used is None:
        return None
    ram_needed, disk_needed = host_bytes(spec, settings)
    ram = free.get("host_ram")
    if spec.device == "cuda" and ram is not None:
        ram = min(ram, spec.offload_cpu_limit) if spec.offload_cpu_limit is not None else ram
        if ram_needed > ram:
            return "host_ram", (f"{used[0]} needs {format_bytes(ram_needed)} of RAM, {format_bytes(ram)} free "
                                "(or memory.offload_cpu_limit)")
    disk = free.get("offload_dir")
    if disk_needed and disk is not None and with_margin(disk_needed + activations_on_disk) > disk:
        return "offload_space", (f"{used[0]} needs {format_bytes(with_margin(disk_needed + activations_on_disk))} "
                                 f"{STORES['offload_dir']} (with a margin), {format_bytes(disk)} free")
    return None


def slow_disk(tier: str, bandwidth: dict[str, float]) -> str | None:
    """Why weight streaming from `tier` is refused on this machine: the disk tier where the measured bandwidth of
    memory.offload_dir's disk is below MIN_DISK_BYTES_PER_S (the speed, in words); None where it is not (a disk
    not measured is priced at the typical figure, not refused)."""
    measured = bandwidth.get("disk")
    if tier != "disk" or measured is None or measured >= MIN_DISK_BYTES_PER_S:
        return None
    return (f"its disk moves {measured / 1e6:.0f} MB/s (measured), below the {MIN_DISK_BYTES_PER_S / 1e6:.0f} MB/s "
            "memory.offload_weights: disk needs to stream the frozen weights in useful time")


def bound_note(spec: ModelSpec, settings: Settings, tokens_per_s: float, resident_tokens_per_s: float,
               links: tuple[float, ...]) -> str | None:
    """What bounds a streaming plan's step: the link (its seconds per micro-batch above the compute's) or the
    compute (the link hidden); None without streaming. `resident_tokens_per_s`: the same settings' price
    without streaming (its micro-batch time is the compute the link hides behind); `links` as `link_seconds`."""
    if not weights_streamed(spec, settings):
        return None
    streamed = streamed_weight_bytes(spec, settings)[0]
    tokens = settings.micro_batch_size * spec.seq_len * spec.world_size
    compute = tokens / resident_tokens_per_s
    link = link_seconds(spec, settings, links)
    bound = "the link" if link > compute else "the compute (the link is hidden)"
    ram, disk = host_bytes(spec, settings)
    held = f"{format_bytes(ram)} of host RAM" + (f" and {format_bytes(disk)} {STORES['offload_dir']}" if disk else "")
    return (f"memory.offload_weights: {settings.offload_weights} streams {format_bytes(streamed)} of frozen weights "
            f"per pass at {links[0] / 1e9:.1f} GB/s{_then(links, settings.offload_weights_ahead)}, "
            f"{settings.offload_weights_ahead} layer{'s' if settings.offload_weights_ahead > 1 else ''} read "
            f"ahead{_kept(settings.offload_weights_resident)}: {link:.2f} s of link per micro-batch against "
            f"{compute:.2f} s of compute; the step is bound by {bound}, {tokens_per_s:,.0f} tokens/s "
            f"({resident_tokens_per_s:,.0f} if the weights fitted on the device); the weights take {held}")


def _kept(resident: int) -> str:
    """The layers that stay on the device (memory.offload_weights_resident), in the plan's note."""
    return f", the first {resident} layer{'s' if resident > 1 else ''} kept on the device" if resident else ""


def _then(links: tuple[float, ...], ahead: int) -> str:
    """The second link of the disk tier on a GPU, in the plan's note: in series, or overlapped."""
    if len(links) < 2:
        return ""
    return f" then {links[1] / 1e9:.1f} GB/s to the GPU ({'in series' if ahead == 1 else 'overlapped'})"


def resident(settings: Settings) -> Settings:
    """`settings` without weight streaming (the compute `bound_note` compares the link with)."""
    return replace(settings, offload_weights="none")
