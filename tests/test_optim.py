"""Optimizers on the tiny Llama: overfitting, fidelity to galore-torch/apollo-torch, resume, state size, errors.

The helpers here (model, examples, train loop) are shared with test_optim_layerwise.py.
"""

from __future__ import annotations

import pytest
import torch

from finetune.errors import FinetuneError
from finetune.optim import build_optimizer, measured_state_bytes, optimizer_state_bytes, register_safe_globals
from finetune.optim.build import trained_specs
from finetune.recipe.schema import OptimizerConfig

ALL = ["adamw", "adamw_8bit", "paged_adamw_8bit", "apollo", "apollo_mini", "galore", "adafactor", "sgd", "muon"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Two shared cores: one thread keeps each run fast and its timing stable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load_model(model_dir, lora: bool = False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        # lm_head is adapted too: on a random tiny model the frozen head caps the logits, so LoRA on the
        # blocks alone cannot drive the loss down.
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS))
    return model


def examples(n: int = 1, length: int = 12, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 400, (1, length), generator=gen) for _ in range(n)]


def backward(model, ids: torch.Tensor, scale: float = 1.0) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    (loss * scale).backward()
    return loss.item()


def train(model, optimizer, batches: list[list[torch.Tensor]], clip: float | None = None) -> list[float]:
    """Plain loop: per optimizer step, backward over its micro-batches (loss / k), clip, step, zero."""
    losses = []
    for micro in batches:
        losses.append(sum(backward(model, ids, 1 / len(micro)) for ids in micro) / len(micro))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses


# (learning rate for full fine-tuning, for LoRA)
LR = {"sgd": (0.03, 0.01), "adafactor": (0.05, 0.1), "apollo": (1e-2, 2e-2), "galore": (3e-2, 3e-2)}
ADAM_LR = (1e-2, 5e-3)


def config(name: str, **kw) -> OptimizerConfig:
    if name == "sgd":
        kw.setdefault("momentum", 0.9)
    return OptimizerConfig(name=name, **kw)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", ALL)
def test_each_optimizer_overfits_one_example(tiny_model_dir, name, lora):
    model = load_model(tiny_model_dir, lora)
    lr = LR.get(name, ADAM_LR)[lora]
    optimizer = build_optimizer(model, config(name), lr)
    (ids,) = examples()
    losses = train(model, optimizer, [[ids]] * (100 if lora else 40))
    assert losses[0] > 5.5
    assert losses[-1] < (1.0 if lora else 0.5), f"{name}: loss {losses[0]:.2f} -> {losses[-1]:.3f}"


def _upstream(name: str, groups: list[dict], lr: float, eps: float):
    if name == "galore":
        from galore_torch import GaLoreAdamW

        return GaLoreAdamW(groups, lr=lr, eps=eps, no_deprecation_warning=True)
    from apollo_torch import APOLLOAdamW

    for g in groups:
        if "rank" in g:
            g["proj"] = "random"
    return APOLLOAdamW(groups, lr=lr, eps=eps)


@pytest.mark.parametrize("name", ["galore", "apollo", "apollo_mini"])
def test_lowrank_step_is_bit_identical_to_upstream(tiny_model_dir, name):
    """Our GaLore/APOLLO step reproduces galore-torch / apollo-torch exactly, projection refresh included."""
    from finetune.optim.build import param_groups
    from finetune.optim.presets import plan_params

    opt = config(name, update_proj_gap=2, weight_decay=0.01)
    ours_model, ref_model = load_model(tiny_model_dir), load_model(tiny_model_dir)
    ours = build_optimizer(ours_model, opt, 1e-2)
    specs, params = trained_specs(ref_model)
    ref = _upstream(name, param_groups(plan_params(name, specs, opt), params, opt), 1e-2, opt.eps)
    batches = [[ids] for ids in examples(4)]
    assert train(ours_model, ours, batches) == train(ref_model, ref, batches)
    for (n, a), b in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b), n


def _save_and_reload(tmp_path, model, optimizer):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt")
    register_safe_globals()
    return torch.load(tmp_path / "ckpt.pt", weights_only=True)


@pytest.mark.parametrize("layerwise", [False, True], ids=["normal", "layerwise"])
@pytest.mark.parametrize("name", ALL)
def test_resume_gives_the_same_later_losses(tiny_model_dir, tmp_path, name, layerwise):
    opt = config(name, layerwise=layerwise, **({"update_proj_gap": 2} if "apollo" in name or "galore" in name else {}))
    lr = LR.get(name, ADAM_LR)[0]
    batches = [[ids] for ids in examples(6)]
    model = load_model(tiny_model_dir)
    uninterrupted = train(model, build_optimizer(model, opt, lr), batches)

    model = load_model(tiny_model_dir)
    optimizer = build_optimizer(model, opt, lr)
    first = train(model, optimizer, batches[:3])
    checkpoint = _save_and_reload(tmp_path, model, optimizer)
    if layerwise:
        optimizer.remove_hooks()
    model = load_model(tiny_model_dir)
    model.load_state_dict(checkpoint["model"])
    optimizer = build_optimizer(model, opt, lr)
    optimizer.load_state_dict(checkpoint["optimizer"])
    assert first + train(model, optimizer, batches[3:]) == uninterrupted


CASES = [(n, lora, False) for n in ALL for lora in (False, True)] + [
    (n, False, True) for n in ("adamw", "adamw_8bit", "apollo", "galore", "adafactor", "muon")]


@pytest.mark.parametrize(("name", "lora", "layerwise"), CASES)
def test_measured_state_bytes_equal_the_prediction(tiny_model_dir, name, lora, layerwise):
    model = load_model(tiny_model_dir, lora)
    opt = config(name, layerwise=layerwise)
    optimizer = build_optimizer(model, opt, 1e-3)
    train(model, optimizer, [examples()])
    specs, _ = trained_specs(model)
    measured = measured_state_bytes(optimizer)
    assert measured > 0 or name == "sgd" and not opt.momentum
    assert measured == optimizer_state_bytes(name, specs, opt)


def test_state_size_predicts_from_meta_shapes_and_low_rank_shrinks_it(tiny_model_dir):
    """The planner passes shapes of a meta-device model; APOLLO-Mini's state is a sliver of AdamW's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    specs, _ = trained_specs(model)
    adamw = optimizer_state_bytes("adamw", specs, config("adamw"))
    assert adamw == sum(8 * torch.Size(s).numel() + 4 for _, s, _ in specs)
    mini = optimizer_state_bytes("apollo_mini", specs, config("apollo_mini"))
    assert mini < adamw / 50  # every 2-D weight, embeddings included, drops to rank 1; norms keep AdamW


def test_galore_rank_not_below_lora_r_is_refused(tiny_model_dir):
    model = load_model(tiny_model_dir, lora=True)
    with pytest.raises(FinetuneError, match="no memory saving") as err:
        build_optimizer(model, config("galore", rank=8), 1e-3)
    assert "adapter.r" in str(err.value)
    build_optimizer(model, config("galore", rank=4), 1e-3)  # below r: fine


def test_galore_8bit_on_cpu_is_refused(tiny_model_dir):
    with pytest.raises(FinetuneError, match="CUDA GPU"):
        build_optimizer(load_model(tiny_model_dir), config("galore_8bit"), 1e-3)


def test_target_modules_matching_nothing_is_refused(tiny_model_dir):
    with pytest.raises(FinetuneError, match="target_modules"):
        build_optimizer(load_model(tiny_model_dir), config("apollo", target_modules=["nonexistent"]), 1e-3)


def test_target_modules_limit_the_projected_weights(tiny_model_dir):
    model = load_model(tiny_model_dir)
    optimizer = build_optimizer(model, config("galore", target_modules=["mlp"]), 1e-3)
    projected = {id(p) for g in optimizer.param_groups if "method" in g for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in projected}
    assert names and all(".mlp." in n for n in names)
    assert len(names) == 3 * model.config.num_hidden_layers


@pytest.mark.parametrize("bad", [{"name": "adamw", "rank": 4}, {"name": "galore", "scale_type": "tensor"},
                                 {"name": "adamw", "momentum": 0.9}])
def test_settings_that_do_not_apply_are_refused_by_the_schema(bad):
    from pydantic import ValidationError

    key = next(k for k in bad if k != "name")
    with pytest.raises(ValidationError, match=f"optimizer.{key}"):
        OptimizerConfig(**bad)


def test_presets_scale_rank_with_width(tiny_model_dir):
    from finetune.optim.presets import plan_params

    specs, _ = trained_specs(load_model(tiny_model_dir))  # hidden 64
    ranks = {n: plan_params(n, specs, config(n)).low_rank for n in ("galore", "apollo", "apollo_mini")}
    assert (ranks["galore"].rank, ranks["galore"].scale) == (16, 0.25)
    assert (ranks["apollo"].rank, ranks["apollo"].scale_type) == (8, "channel")
    assert (ranks["apollo_mini"].rank, ranks["apollo_mini"].scale_type, ranks["apollo_mini"].scale) == (1, "tensor", 128)
    plan = plan_params("galore", specs, config("galore"))
    assert [s[0] for s in plan.own] == [s[0] for s in specs if len(s[1]) == 2]  # embeddings included
    assert plan.undecayed and all(len(s[1]) == 1 for s in plan.undecayed)


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "apollo", "galore", "adafactor", "muon"])
def test_state_bytes_prediction_holds_for_bf16_weights(tiny_model_dir, name):
    model = load_model(tiny_model_dir).to(torch.bfloat16)
    optimizer = build_optimizer(model, config(name), 1e-3)
    train(model, optimizer, [examples()])
    specs, _ = trained_specs(model)
    assert measured_state_bytes(optimizer) == optimizer_state_bytes(name, specs, config(name))


def test_recipe_checks_from_the_registry_name_the_keys():
    from pydantic import ValidationError

    from finetune.recipe.schema import Recipe

    def recipe(**sections):
        return Recipe.model_validate({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, **sections})

    recipe(optimizer={"name": "galore"})
    with pytest.raises(ValidationError, match="optimizer.rank=16 >= adapter.r=16"):
        recipe(optimizer={"name": "galore", "rank": 16}, adapter={"r": 16})
    recipe(optimizer={"name": "galore", "rank": 64}, adapter={"type": "full"}, quantization={"bits": None})
    with pytest.raises(ValidationError, match="optimizer.layerwise with model.dtype=fp16"):
        recipe(optimizer={"name": "adamw", "layerwise": True}, model={"path": "m", "dtype": "fp16"})


def test_muon_orthogonalizes_hidden_matrices_and_leaves_the_rest_to_adamw(tiny_model_dir):
    """Embeddings, the LM head (and LoRA adapters on it) and norms go to AdamW; 2-D hidden weights to Muon."""
    for lora in (False, True):
        model = load_model(tiny_model_dir, lora)
        optimizer = build_optimizer(model, config("muon"), 1e-3)
        muon, adamw = optimizer.parts
        assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
        names = {id(p): n for n, p in model.named_parameters()}
        in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
        in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        assert in_muon | in_adamw == trained and not in_muon & in_adamw
        assert in_muon and all(".layers." in n and model.get_parameter(n).dim() == 2 for n in in_muon)
        assert any("lm_head" in n for n in in_adamw) and all("embed" not in n and "lm_head" not in n for n in in_muon)
