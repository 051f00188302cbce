"""Mixture-of-experts families: the experts implementation against transformers' own, training through
`finetune run` with the plan next to the measured peak, the router's aux loss, adapter targets, full-size
configs planned, and the careless inputs (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.cli import main
from finetune.rundir import read_jsonl
from finetune.testing import MOE_ARCHITECTURES, tiny_config
from tests.run_support import three_step_recipe as _recipe

FAMILIES = list(MOE_ARCHITECTURES)
WITH_AUX_LOSS = {"qwen3_moe", "mixtral", "olmoe", "gpt_oss"}  # DeepSeek-V3 and GLM-4-MoE balance with a bias
CONFIGS = Path(__file__).parent / "fixtures" / "configs"
MOE_CONFIGS = ["qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b", "gpt-oss-20b", "deepseek-v2-lite", "glm-4.5-air"]


def _tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size=300), dtype=torch.float32)


@pytest.mark.parametrize("arch", FAMILIES)
def test_experts_match_transformers(arch):
    """Our experts implementation gives transformers' eager outputs and gradients (routing, gating layout,
    biases, gpt-oss's transposed interleaved experts, shared experts)."""
    from finetune.model.moe import moe_blocks, use_finetune_experts

    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    results = []
    for ours in (False, True):
        model = _tiny_model(arch)
        model.set_experts_implementation("eager")
        if ours:
            assert use_finetune_experts(model) == len(moe_blocks(model)) > 0
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss)
    assert any(".experts." in n for n in grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_blocks_found_generically():
    """experts_of reads each family's layout: experts, router, shared experts."""
    from finetune.model.moe import moe_blocks

    found = {arch: moe_blocks(_tiny_model(arch)) for arch in FAMILIES}
    assert {arch: len(blocks) for arch, blocks in found.items()} == {
        "qwen3_moe": 2, "mixtral": 2, "olmoe": 2, "gpt_oss": 2, "deepseek_v3": 1, "glm4_moe": 1}
    assert found["gpt_oss"][0].weights == ("gate_up_proj", "down_proj")  # the biases are 2-D
    assert found["deepseek_v3"][0].shared == ("shared_experts",) and found["qwen3_moe"][0].shared == ()
    assert all(b.router is not None and b.router.weight.shape[0] == b.num_experts
               for blocks in found.values() for b in blocks)


def test_chunked_loss_adds_the_same_aux_loss():
    """The chunked loss runs the decoder without the model's head: it adds the router's aux loss as the
    model's own forward does, and both log it."""
    from finetune.model.moe import use_finetune_experts
    from finetune.step.training_step import compute_loss

    model = _tiny_model("qwen3_moe")
    use_finetune_experts(model)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    plain, chunked = {}, {}
    a = compute_loss(model, {"input_ids": ids, "labels": ids}, metrics=plain)
    b = compute_loss(model, {"input_ids": ids, "labels": ids}, chunked_loss=True, metrics=chunked)
    torch.testing.assert_close(a, b)
    assert plain["aux_loss"][0] == pytest.approx(chunked["aux_loss"][0]) and plain["aux_loss"][0] > 0
    without = model(input_ids=ids, labels=ids).loss  # the config's output_router_logits is off: no aux loss
    assert float((a - without).detach()) == pytest.approx(model.config.router_aux_loss_coef * plain["aux_loss"][0], rel=1e-4)


def test_tiled_mlp_leaves_moe_blocks_out():
    """The tiled MLP runs dense MLPs only: gpt-oss's GptOssMLP is a MoE block (it returns router scores),
    DeepSeek-V3's first layer is dense."""
    from finetune.memory.layer_recompute import tile_mlps

    assert tile_mlps(_tiny_model("gpt_oss"), 4) == 0
    assert tile_mlps(_tiny_model("deepseek_v3"), 4) == 1


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_trains_with_its_plan(tmp_path, arch, capsys):
    """3 steps through `finetune run`; the plan (traced on meta, worst-case routing) within 5% of the
    measured peak; the aux loss logged where the family has one; experts and routers frozen."""
    assert main(["run", str(_recipe(tmp_path, arch))]) == 0, capsys.readouterr().err
    run_dir = tmp_path / "run"
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)
    assert all(("aux_loss" in r) == (arch in WITH_AUX_LOSS) for r in rows)
    planned = json.loads((run_dir / "plan.json").read_text())["peak_bytes"]
    measured = max(r["peak_memory_bytes"] for r in rows)
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert not config.get("target_parameters") and "gate" not in config["target_modules"]
    assert main(["generate", str(run_dir), "--prompt", "What is 2 plus 2?", "--max-new-tokens", "4"]) == 0


def test_target_experts_trains_expert_lora(tmp_path, capsys):
    """adapter.target_experts: LoRA on the fused expert weights through peft's target_parameters, planned
    like any run (the trace runs peft's fold of the update into each layer's experts): within 5%."""
    path = _recipe(tmp_path, "qwen3_moe", {"adapter": {"target_experts": True, "dropout": 0.0}})
    assert main(["run", str(path)]) == 0, capsys.readouterr().err
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    planned = json.loads((tmp_path / "run" / "plan.json").read_text())["peak_bytes"]
    measured = max(r["peak_memory_bytes"] for r in rows)
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]


def _refused(tmp_path: Path, capsys, argv: list[str], *words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err)
    assert any(all(w in line for w in words) for line in err), err  # a recipe problem is listed below
    assert not (tmp_path / "run").exists()  # nothing written (a run directory made is removed)


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
def test_target_experts_on_a_dense_model(tmp_path, capsys, command):
    path = _recipe(tmp_path, "llama", {"adapter": {"target_experts": True, "dropout": 0.0}})
    _refused(tmp_path, capsys, [command, str(path)], "adapter.target_experts", "Llama", "not a mixture-of-experts")


def test_target_experts_with_dropout(tmp_path, capsys):
    path = _recipe(tmp_path, "qwen3_moe", {"adapter": {"target_experts": True, "dropout": 0.1}})
    _refused(tmp_path, capsys, ["run", str(path)], "adapter.target_experts", "adapter.dropout: 0")


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_full_size_config_plans(name):
    """Published configs plan without error: QLoRA at 8k tokens, bf16 on a GPU."""
    from finetune.plan import predict
    from finetune.recipe import load_recipe

    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "qlora-8b-24gb.yaml",
                         [f"model.path={CONFIGS / name}.json", "memory.gpu_memory=80GiB"])
    plan = predict(recipe, device="cuda")
    assert plan.peak_bytes > 0 and plan.settings is not None
    # the tiled MLP runs dense MLPs: left out, saying why, where the first layer is a MoE block
    left_out = any("memory.tiled_mlp left out" in note for note in plan.notes)
    assert left_out == (name not in ("deepseek-v2-lite", "glm-4.5-air")) and (not left_out or not plan.settings["tiled_mlp"])


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_four_bit_experts_match_their_dequantized_reference(arch):
    """bits 4: each expert matrix is bitsandbytes' NF4 of it (dequantized bit for bit as bnb does), the
    16-bit parameters are gone, and loss and gradients equal those of the model holding the dequantized
    weights in 16 bits."""
    import bitsandbytes.functional as bnbf

    from finetune.model.expert_store import quantize_experts
    from finetune.model.moe import expert_matrix, moe_blocks, use_finetune_experts
    from finetune.recipe.schema import QuantizationConfig

    model = _tiny_model(arch)
    use_finetune_experts(model)
    original = {(b.name, w): getattr(b.experts, w).detach().clone() for b in moe_blocks(model) for w in b.weights}
    assert quantize_experts(model, QuantizationConfig(bits=4)) == len(original)
    reference = _tiny_model(arch)
    use_finetune_experts(reference)
    for block, ref_block in zip(moe_blocks(model), moe_blocks(reference), strict=True):
        assert not any(p.dim() == 3 for p in block.experts.parameters())
        for w in block.weights:
            q, state = bnbf.quantize_4bit(original[(block.name, w)][1].contiguous(), blocksize=64,
                                          compress_statistics=True, quant_type="nf4")
            assert torch.equal(expert_matrix(block.experts, w, 1, torch.float32), bnbf.dequantize_4bit(q, state))
            with torch.no_grad():
                getattr(ref_block.experts, w).copy_(torch.stack([
                    expert_matrix(block.experts, w, e, torch.float32) for e in range(block.num_experts)]))
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    grads = []
    for m in (model, reference):
        for p in m.parameters():
            p.requires_grad_(False)
        m.enable_input_require_grads()
        embeds = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        loss = m(inputs_embeds=embeds, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), embeds.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("arch", "memory"), [
    ("qwen3_moe", {}), ("deepseek_v3", {}),
    ("olmoe", {"chunked_loss": True, "activation_checkpointing": True}),  # the aux loss beside the chunked loss
])
def test_four_bit_experts_train_with_their_plan(tmp_path, arch, memory, capsys):
    """QLoRA on a MoE model: experts stored in 4 bits, priced as stored (plan within 5% of the peak)."""
    path = _recipe(tmp_path, arch, {"quantization": {"bits": 4}}, {"memory": memory})
    assert main(["run", str(path)]) == 0, capsys.readouterr().err
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    planned = json.loads((tmp_path / "run" / "plan.json").read_text())["peak_bytes"]
    measured = max(r["peak_memory_bytes"] for r in rows)
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)


def test_qwen3_30b_experts_priced_in_four_bits():
    """Qwen3-30B-A3B QLoRA: the experts (~57 GB in bf16) are priced as 4-bit storage, so it fits 24 GB."""
    from finetune.plan import predict
    from finetune.recipe import load_recipe

    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "qlora-8b-24gb.yaml",
                         [f"model.path={CONFIGS / 'qwen3-30b-a3b'}.json", "data.max_seq_len=2048",
                          "memory.offload_weights=none"])  # every weight on the device: priced as stored
    plan = predict(recipe, device="cuda")
    assert plan.fits and plan.breakdown["weights"] < 17 * 2**30
    sixteen = predict(recipe.model_copy(update={"quantization": recipe.quantization.model_copy(
        update={"bits": None})}), device="cuda")
    assert sixteen.breakdown["weights"] > 55 * 2**30


@pytest.mark.parametrize("bits", [4, None])
def test_expert_offload_trains_the_same(tmp_path, bits, capsys):
    """memory.offload_experts: the experts (4-bit or 16-bit) resident, in host RAM or in files on disk, fetched
    per layer (ahead in forward, below in backward): the same losses step for step; on disk (which frees a
    CPU run's memory too: two of the four layers' experts stay) the plan within 5% of the measured peak, which
    is lower than resident, and no file left in offload_dir."""
    losses, peaks = {}, {}
    for tier in ("none", "cpu", "disk", True):  # true: the key's old value, host RAM
        folder = tmp_path / str(tier)
        path = _recipe(folder, "qwen3_moe", {"quantization": {"bits": bits}},
                       {"memory": {"offload_experts": tier, "activation_checkpointing": True,
                                   "offload_dir": str(folder / "experts")}}, num_hidden_layers=4)
        assert main(["run", str(path)]) == 0, capsys.readouterr().err
        rows = [r for r in read_jsonl(folder / "run" / "metrics.jsonl") if "loss" in r]
        losses[tier] = [(r["loss"], r["aux_loss"]) for r in rows]
        peaks[tier] = max(r["peak_memory_bytes"] for r in rows)
        planned = json.loads((folder / "run" / "plan.json").read_text())["peak_bytes"]
        if tier in ("none", "disk"):
            assert abs(planned - peaks[tier]) <= 0.05 * peaks[tier], (tier, planned, peaks[tier])
        assert not (folder / "experts").exists()  # nothing left: neither files nor the folder the run made
    assert len(losses["none"]) == 3 and losses["none"] == losses["cpu"] == losses["disk"] == losses[True]
    assert peaks["disk"] < peaks["none"]


def test_expert_offload_to_disk_writes_the_experts_and_removes_them(tmp_path):
    """memory.offload_experts: disk: one file per expert tensor as stored, of its size, while training; the
    model's copies without bytes; the same loss and gradients as resident; close() deletes the files."""
    from finetune.memory.expert_offload import expert_bytes, offload_experts
    from finetune.model.moe import moe_blocks, use_finetune_experts

    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(5))
    results = []
    for tier in ("none", "disk"):
        model = _tiny_model("qwen3_moe")
        use_finetune_experts(model)
        sizes = sorted(t.numel() * t.element_size() for b in moe_blocks(model) for t in
                       (getattr(b.experts, w) for w in b.weights))
        total = expert_bytes(model)
        offload = offload_experts(model, tier, None, tmp_path / "experts")
        if offload is not None:
            files = list((tmp_path / "experts").iterdir())
            assert sorted(f.stat().st_size for f in files) == sizes and sum(sizes) == total == offload.host_bytes
            assert all(s.nbytes() == 0 for storages in offload.storages for s in storages)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        if offload is not None:
            assert len(list((tmp_path / "experts").iterdir())) == len(sizes)  # read, not consumed
            offload.close()
            assert not (tmp_path / "experts").exists()  # the files deleted, and the folder the offload made
    (ref_loss, ref_grads), (loss, grads) = results
    assert torch.equal(loss, ref_loss) and {n for n in ref_grads if n not in grads} == {
        n for n in ref_grads if ".experts." in n}  # offloaded experts are frozen buffers
    assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())


def test_expert_offload_with_too_little_host_ram(tmp_path, capsys):
    path = _recipe(tmp_path, "qwen3_moe", {"memory": {"offload_experts": "cpu", "offload_cpu_limit": "1KiB"}})
    _refused(tmp_path, capsys, ["run", str(path)], "memory.offload_experts", "host RAM", "1.00 KiB")


def test_expert_offload_dir_not_writable(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    path = _recipe(tmp_path, "qwen3_moe", {"memory": {"offload_experts": "disk",
                                                      "offload_dir": str(tmp_path / "file" / "experts")}})
    _refused(tmp_path, capsys, ["run", str(path)], "memory.offload_dir", "not writable")


def test_expert_offload_dir_too_small(tmp_path, capsys, monkeypatch):
    """A disk without room for the experts: the plan (unless memory.plan is off) and the run's own check say so."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 4096))
    path = _recipe(tmp_path, "qwen3_moe", {"memory": {"offload_experts": "disk", "plan": False,
                                                      "offload_dir": str(tmp_path / "experts")}})
    _refused(tmp_path, capsys, ["run", str(path)], "memory.offload_dir", "4.00 KiB free", "of expert weights")


def test_expert_offload_planned_on_gpus():
    """Qwen3-30B-A3B QLoRA at 12 GB: the search turns expert offload on (the experts' ~15 GiB leave the
    device but for two layers); with it off nothing fits."""
    from finetune.plan import predict
    from finetune.recipe import load_recipe

    base = [f"model.path={CONFIGS / 'qwen3-30b-a3b'}.json", "data.max_seq_len=2048", "memory.gpu_memory=12GiB",
            "memory.offload_weights=none"]  # the experts alone move (weight streaming would move the rest too)
    recipes = Path(__file__).parents[1] / "recipes"
    on = predict(load_recipe(recipes / "qlora-8b-24gb.yaml", [*base, "memory.offload_experts=auto"]), device="cuda")
    off = predict(load_recipe(recipes / "qlora-8b-24gb.yaml", [*base, "memory.offload_experts=false"]), device="cuda")
    assert on.fits and on.settings["offload_experts"] == "cpu" and on.breakdown["weights"] < 3 * 2**30
    assert not off.fits


def test_expert_offload_to_disk_planned_where_ram_is_short(tmp_path):
    """The search keeps the experts in RAM when they fit there and takes the disk (slower: its measured link)
    only where host RAM is short (memory.offload_cpu_limit here); the disk's price is its reads per pass."""
    from finetune.plan import predict
    from finetune.recipe import load_recipe

    base = [f"model.path={CONFIGS / 'olmoe-1b-7b'}.json", "data.max_seq_len=2048", "memory.gpu_memory=3GiB",
            f"memory.offload_dir={tmp_path}", "memory.offload_experts=auto", "memory.offload_weights=none"]
    recipe = Path(__file__).parents[1] / "recipes" / "qlora-8b-24gb.yaml"
    roomy = predict(load_recipe(recipe, base), device="cuda")
    short = predict(load_recipe(recipe, [*base, "memory.offload_cpu_limit=1GiB"]), device="cuda")
    assert roomy.fits and roomy.settings["offload_experts"] == "cpu"
    assert short.fits and short.settings["offload_experts"] == "disk"
    assert short.peak_bytes == pytest.approx(roomy.peak_bytes, rel=0.3) and short.tokens_per_s < roomy.tokens_per_s
    assert any(c.kind == "host_ram" and "expert offload to cpu" in c.reason for c in short.rejected)


def test_expert_offload_keeps_two_layers_and_prefetches_in_the_pass_direction():
    """Two MoE layers hold device copies: the computing one and the one arriving (the next layer in forward,
    the layer below in backward; at either end the one where the next pass starts)."""
    from transformers import AutoModelForCausalLM

    from finetune.memory.expert_offload import expert_bytes, offload_experts
    from finetune.model.moe import moe_blocks, use_finetune_experts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", vocab_size=300, num_hidden_layers=4))
    use_finetune_experts(model)
    experts = expert_bytes(model)
    offload = offload_experts(model, "cpu", None)
    seen: list[tuple[int, list[int]]] = []
    for position, block in enumerate(moe_blocks(model)):
        block.experts.register_forward_hook(lambda m, a, o, p=position: seen.append((p, sorted(offload.resident))))
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(4))
    model(input_ids=ids, labels=ids).loss.backward()
    assert seen == [(0, [0, 1]), (1, [1, 2]), (2, [2, 3]), (3, [2, 3])]
    assert sorted(offload.resident) == [0, 1]  # backward came down to the first layer; the next forward's second
    # 4 layers x 8 experts x (gate_up [2 x 32, 64] + down [64, 32]) x fp32
    assert offload.host_bytes == experts == 4 * 8 * (2 * 32 * 64 + 64 * 32) * 4


@pytest.mark.xfail(strict=True, reason="peft 0.21.2's transformers-4 MoE conversion turns every spelling of the "
                   "shared experts' gate_proj/up_proj/down_proj (bare, full path, regex) into LoRA on the routed "
                   "experts (huggingface/peft#3711, fix under review in #3715), so adapter_targets leaves them "
                   "frozen; this passes once the installed peft keeps full paths of Linear layers as modules")
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_shared_experts_carry_lora(tmp_path, arch):
    """all-linear on DeepSeek-V3 / GLM-4-MoE: the shared experts' projections (dense MLPs inside the MoE block)
    carry LoRA weights that receive gradients, the routed experts none, and the saved adapter reloads equal."""
    from peft import PeftModel

    from finetune.model.adapter import apply_adapter
    from finetune.recipe.schema import AdapterConfig

    model = apply_adapter(_tiny_model(arch), AdapterConfig(dropout=0.0), checkpointing=False)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(6))
    model(input_ids=ids, labels=ids).loss.backward()
    shared = {n: p for n, p in model.named_parameters() if ".shared_experts." in n and "lora_" in n}
    assert {n.split(".shared_experts.")[1].split(".")[0] for n in shared} == {"gate_proj", "up_proj", "down_proj"}
    assert all(p.grad is not None for n, p in shared.items() if "lora_A" in n)
    assert not any(".experts." in n and "lora_" in n for n, _ in model.named_parameters())
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(_tiny_model(arch), tmp_path / "adapter")
    model.eval()
    torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_measure_with_experts_on_disk_leaves_no_file(tmp_path):
    """`finetune measure` (finetune.train.measure) with memory.offload_experts: disk measures the step with the
    experts read from offload_dir and removes their files, and the folder it made for them, before it returns."""
    from finetune.recipe import load_recipe
    from finetune.train.measure import measure

    path = _recipe(tmp_path, "qwen3_moe", {"memory": {"offload_experts": "disk", "activation_checkpointing": True,
                                                      "offload_dir": str(tmp_path / "experts")}})
    result = measure(load_recipe(path), steps=1)
    assert result["peak_bytes"] > 0 and result["settings"]["offload_experts"] == "disk"
    assert not (tmp_path / "experts").exists()
