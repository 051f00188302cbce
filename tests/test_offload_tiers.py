"""The offload tier contract: a test double tier goes through the same table, spill chain and planner as
the real ones (adding a tier is one table entry and its class)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from offload_fake import RecordingTier, register, tier_entry
from test_offload_support import batch, load, make_model_dir, step

from finetune.memory.offload import ActivationOffload, activation_offload, tier_limits
from finetune.memory.offload_tier import OffloadTier, SpillChain, StoredTensor, TierSetup, build_chain
from finetune.plan import predict
from finetune.plan.cost_model import LINK_BYTES_PER_S, tokens_per_second
from finetune.plan.memory_model import Settings
from finetune.plan.search import model_spec
from finetune.plan.trace import model_facts, planned_config
from finetune.recipe import offload_tiers
from finetune.recipe.offload_tiers import chain_names
from finetune.recipe.schema import MemoryConfig, Recipe

model_dir = pytest.fixture(scope="module")(make_model_dir)


def test_the_fake_sees_store_fetch_get_release_drain_close_in_order(model_dir, monkeypatch):
    register(monkeypatch, tier_entry(prefetch_layers=1))
    model = load(model_dir, "full", checkpointing=False)
    reference = step(model)
    offload = ActivationOffload(model, "fake", min_size=1024)
    fake = offload.chain.tier("fake")
    grads = step(model, offload)
    offload.close()
    assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))
    log = fake.log
    stores = [key for kind, key in log if kind == "store"]
    assert stores and len(stores) == offload.stats["offloaded_tensors"]
    # Forward stores everything before backward fetches anything; each copy is fetched, read, released.
    assert log[:len(stores)] == [("store", key) for key in stores]
    for key in stores:
        own = [kind for kind, k in log if k == key]
        assert own[0] == "store" and own[-1] == "release" and own.index("fetch") < own.index("get")
    assert log[-2:] == [("drain", None), ("close", None)]
    assert fake.held == {} and fake.held_bytes == 0  # nothing left after the step, nor after close
    assert offload.stats["spilled_bytes"] == 0


def test_a_full_tier_spills_into_the_next_one_of_its_chain(model_dir, monkeypatch):
    """`fake` holds 8 KiB then hands over to `fake_b`: gradients stay bit-identical, every byte is counted."""
    register(monkeypatch, tier_entry(spill_to="fake_b"), tier_entry("fake_b"), tier_entry("loop", spill_to="loop"))
    assert chain_names("fake", {}) == ["fake"]  # without a limit it never fills up
    assert chain_names("fake", {"fake": 1}) == ["fake", "fake_b"]
    with pytest.raises(ValueError, match="spills back into its own chain"):
        chain_names("loop", {"loop": 1})
    model = load(model_dir, "lora", checkpointing=False)
    reference = step(model)
    offload = ActivationOffload(model, "fake", min_size=1024, limits={"fake": 8192})
    first, second = offload.chain.tier("fake"), offload.chain.tier("fake_b")
    with offload:  # forward only: what each tier holds once the step's tensors are all stored
        model(**batch())
        assert 0 < first.held_bytes <= 8192 and ("full", None) in first.log and second.held_bytes > 0
        assert offload.stats["spilled_bytes"] == second.held_bytes
        assert first.held_bytes + second.held_bytes == offload.stats["offloaded_bytes"]
    assert first.held == second.held == {}  # a step without backward leaves nothing either
    assert first.log[-1] == second.log[-1] == ("drain", None)
    grads = step(model, offload)
    offload.close()
    assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))
    for tier in (first, second):
        assert tier.held == {} and tier.log[-1] == ("close", None)


def test_when_every_tier_is_full_tensors_stay_on_the_device(model_dir, monkeypatch):
    register(monkeypatch, tier_entry())
    model = load(model_dir, "full", checkpointing=True)
    reference = step(model)
    offload = ActivationOffload(model, "fake", min_size=1024, limits={"fake": 0})
    grads = step(model, offload)
    offload.close()
    assert offload.stats["offloaded_tensors"] == 0 and offload.chain.tier("fake").log.count(("full", None)) > 0
    assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))


def test_chain_drains_and_closes_every_tier_even_after_an_error():
    class Failing:
        def drain(self):
            raise KeyboardInterrupt

        close = drain

    fake = RecordingTier(TierSetup(None, None, None))
    chain = SpillChain([("failing", Failing()), ("fake", fake)])
    with pytest.raises(KeyboardInterrupt):
        chain.drain()
    with pytest.raises(KeyboardInterrupt):
        chain.close()
    assert fake.log == [("drain", None), ("close", None)]


def test_unknown_tier_and_recipe_values_come_from_the_table(model_dir, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="known: cpu, disk"):
        ActivationOffload(load(model_dir), "tape", min_size=1024)
    with pytest.raises(ValueError, match="'none', 'cpu', 'disk' or 'auto'"):
        MemoryConfig(offload="tape")
    # Limits come from the recipe keys the table names; a tier limited by one spills per its entry.
    cfg = MemoryConfig(offload="cpu", offload_cpu_limit="4KiB")
    assert tier_limits(cfg) == {"cpu": 4096} and chain_names("cpu", tier_limits(cfg)) == ["cpu", "disk"]
    register(monkeypatch, tier_entry(limit_key="offload_cpu_limit", spill_to="fake_b"), tier_entry("fake_b"))
    model = load(model_dir)
    offload = activation_offload(model, cfg.model_copy(update={"offload": "fake"}), tmp_path)
    try:
        assert [name for name, _ in offload.chain.tiers] == ["fake", "fake_b"]
        assert offload.chain.tier("fake").limit == 4096
    finally:
        offload.close()


@pytest.mark.parametrize("name", list(offload_tiers.tier_names()))
def test_every_table_entry_builds_a_tier_that_keeps_the_contract(name, tmp_path):
    """Each real entry is complete (known link and store, a known tier to spill to) and its class honours the
    protocol on its own: the bytes come back exactly, and nothing is left after drain and close."""
    spec = offload_tiers.tier_spec(name)
    assert spec.link in LINK_BYTES_PER_S and spec.holds_in in offload_tiers.STORES and spec.prefetch_layers >= 0
    assert spec.spill_to is None or (spec.spill_to in offload_tiers.tier_names() and spec.limit_key)
    chain = build_chain(name, None, tmp_path / "dir", {name: 1 << 20})
    tier = chain.tier(name)
    assert isinstance(tier, OffloadTier)
    tensor = torch.randn(64, 32).t()  # not contiguous: the copy keeps its strides
    item = tier.store(tensor, torch.empty_like(tensor, device="meta"), tensor.numel() * 4)
    assert isinstance(item, StoredTensor)
    item.fetch()
    back = item.get()
    assert torch.equal(back, tensor) and back.stride() == tensor.stride()
    if spec.limit_key:  # over its limit: full, the chain moves on
        assert tier.store(tensor, torch.empty_like(tensor, device="meta"), 2 << 20) is None
    del back
    item.release()
    tier.drain()
    kept = tier.store(tensor, torch.empty_like(tensor, device="meta"), tensor.numel() * 4)
    chain.close()  # releases what is still held
    with pytest.raises(RuntimeError, match="offload step ended"):
        kept.get()
    assert not (tmp_path / "dir").exists() or list((tmp_path / "dir").iterdir()) == []


# -- the planner reads the table only ----------------------------------------------------------------------

def _recipe(path, offload: str) -> Recipe:
    """Everything fixed but `memory.offload` (set after validation: the schema's list is the real table's)."""
    recipe = Recipe.model_validate({
        "model": {"path": str(path)}, "data": {"path": "unused.jsonl", "max_seq_len": 256},
        "quantization": {"bits": None}, "optimizer": {"name": "adamw"},
        "training": {"micro_batch_size": 1},
        "memory": {"activation_checkpointing": False, "chunked_loss": False, "tiled_mlp": False,
                   "gpu_memory_margin": 0}})
    return recipe.model_copy(update={"memory": recipe.memory.model_copy(update={"offload": offload})})


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Bandwidths are 'measured' at fixed speeds, in a fresh cache."""
    import finetune.memory.bandwidth as bandwidth

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bandwidth, "measure_disk", lambda directory, nbytes=0: {"write": 2e9, "read": 2e9})


def test_planner_prices_and_chooses_a_tier_from_its_entry(model_dir, monkeypatch, measured):
    """A tier that moves more (no read-ahead) fits a budget disk does not; roomy budgets keep no offload; a
    tier that frees nothing on this device is never tried."""
    register(monkeypatch, tier_entry(), tier_entry("useless", frees_device_on=()))
    recipe = _recipe(model_dir, "auto")
    peak = {name: predict(_recipe(model_dir, name), gpu_memory=1 << 40, device="cpu").peak_bytes
            for name in ("none", "disk", "fake")}
    assert peak["fake"] < peak["disk"] < peak["none"]
    plan = predict(recipe, gpu_memory=(peak["fake"] + peak["disk"]) // 2, device="cpu")
    assert plan.fits and plan.settings["offload"] == "fake"
    tried = {c.settings["offload"] for c in plan.rejected + plan.alternatives}
    assert "disk" in tried and "useless" not in tried
    roomy = predict(recipe, gpu_memory=1 << 40, device="cpu")
    assert roomy.settings["offload"] == "none"
    assert {c.settings["offload"] for c in roomy.alternatives} == {"disk", "fake"}


def test_cost_model_prices_a_tier_by_its_link_and_overhead(monkeypatch):
    register(monkeypatch, tier_entry("fake_disk", link="disk"), tier_entry("fake_pcie", link="host_device"),
             tier_entry("fake_slow", link="host_device", overhead=0.5),
             tier_entry("fake_disk_like", link="disk", overhead=0.03))
    measured = {"disk": 1e8, "host_device": 1e12}

    path = str(Path(__file__).parent / "fixtures" / "configs" / "llama-3.2-1b.json")  # 1.2 B, 16 layers, 2048 wide
    config = planned_config(path)
    recipe = Recipe.model_validate({"model": {"path": path, "dtype": "bf16"}, "quantization": {"bits": None},
                                    "data": {"path": "unused.jsonl", "max_seq_len": 4096}, "adapter": {"type": "lora"}})

    def speed(tier: str, device: str = "cuda") -> float:
        settings = Settings(micro_batch_size=1, gradient_accumulation_steps=1, activation_checkpointing=False,
                            checkpoint_every_n_layers=1, offload=tier, chunked_loss=False, bits=None,
                            optimizer="adamw")
        return tokens_per_second(model_spec(recipe, config, device), model_facts(config, "sdpa")[0], settings,
                                 offloaded_bytes=8 << 30, bandwidth=measured)

    assert speed("fake_disk") < 0.5 * speed("fake_pcie")  # 8 GiB each way at 100 MB/s vs 1 TB/s
    assert speed("fake_pcie") == pytest.approx(speed("none"))  # hidden behind compute, no overhead
    assert speed("fake_slow") == pytest.approx(speed("fake_pcie") / 1.5)
    assert speed("fake_disk_like", "cpu") == speed("disk", "cpu")  # same facts, same price


def test_whether_a_tier_keeps_weights_on_the_host_comes_from_its_entry(monkeypatch):
    """A run loads offloaded experts onto the host when the tier's entry says its bytes stay there (RAM and disk
    do), not from the tier's name; `none` keeps them on the device."""
    register(monkeypatch, tier_entry("peer", on_host=False), tier_entry("fake"))
    assert [offload_tiers.on_host(n) for n in ("cpu", "disk", "fake", "peer", "none")] == [True, True, True, False,
                                                                                             False]
