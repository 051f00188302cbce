"""finetune.compat: every private torch / transformers API in one place, each checked against the versions it
was verified on, with a clear error (or a public fallback) where a library no longer has it."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest
import torch

from finetune import compat
from finetune.errors import FinetuneError

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes")


def test_every_private_api_was_checked_on_the_installed_version():
    """Fails after an upgrade until each API is checked on the new version and its range widened."""
    assert compat.check_all() == []
    assert all(api.checked() for api in compat.PRIVATE.values())


@pytest.mark.parametrize(("installed", "checked"), [("2.13.0+cpu", True), ("2.4.1", True), ("2.3.9", False),
                                                     ("2.14.0.dev20260101", False), ("3.0", False), ("none", False)])
def test_the_version_range_includes_both_ends_by_major_minor(installed, checked, monkeypatch):
    monkeypatch.setitem(compat.CHECKED, "torch", ("2.4", "2.13"))
    assert compat.PrivateAPI("x", "torch").checked(installed) is checked


def _newer_transformers(monkeypatch, installed="9.1.0"):
    """Simulate an install outside the checked range: transformers' metadata says `installed`."""
    real = compat.version
    monkeypatch.setattr(compat, "version", lambda lib: installed if lib == "transformers" else real(lib))
    monkeypatch.setattr(compat, "_seen", set())
    monkeypatch.setattr(compat, "_noted", False)


def test_outside_the_range_one_plain_line_per_process_names_version_range_and_fix(monkeypatch, capsys):
    """No UserWarning with a source line: one line on stderr, once, with the command that installs the tested
    version (from the lock); the API is still tried."""
    _newer_transformers(monkeypatch)
    from finetune.testing import tiny_config

    config = tiny_config("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.set_attn_implementation(config, "eager")
        assert compat.attn_implementation(config) == "eager"
        assert compat.supports_sdpa(None)
    lines = capsys.readouterr().err.splitlines()
    oldest, newest = compat.CHECKED["transformers"]
    pinned = compat.tested_versions()["transformers"]
    assert lines == [f"note: finetune was not tested with transformers 9.1.0 (checked on {oldest} to {newest}); "
                     f"it tries them; the tested versions: pip install transformers=={pinned}"]
    assert any(line.startswith(f"PretrainedConfig._attn_implementation: checked on transformers {oldest} to "
                               f"{newest}, installed 9.1.0") for line in compat.check_all())


def test_a_tested_install_prints_nothing(monkeypatch, capsys):
    monkeypatch.setattr(compat, "_seen", set())
    monkeypatch.setattr(compat, "_noted", False)
    t = torch.zeros(2)
    compat.tensor_version(t)
    compat.foreach_norm([t])
    assert compat.untested_note() is None and capsys.readouterr().err == ""


def test_a_gone_api_stops_with_one_line_saying_what_to_install(monkeypatch):
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    q = torch.zeros(1, 1, 4, 8, device="meta")
    with pytest.raises(FinetuneError) as info:
        compat.flash_attention_cpu(q, q, q, 0.0, True, None, None)
    text = str(info.value)
    assert "lacks torch.ops.aten._scaled_dot_product_flash_attention_for_cpu" in text
    oldest, newest = compat.CHECKED["torch"]
    major, minor = map(int, newest.split("."))
    assert f"checked on torch {oldest} to {newest}" in text and f"install torch>={oldest},<{major}.{minor + 1}" in text

    class Bare:
        pass

    with pytest.raises(FinetuneError, match="lacks PretrainedConfig._attn_implementation"):
        compat.attn_implementation(Bare())


def test_the_wrapped_apis_do_what_finetune_relies_on():
    x = torch.ones(3, requires_grad=True)
    loss = (x * x).sum()
    compat.engine_backward(loss)
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    q = torch.zeros(2, 4, 16, 8, device="meta")
    assert compat.flash_attention_cpu(q, q, q, 0.0, True, None, None).shape == (2, 4, 16, 8)
    norms = compat.foreach_norm([torch.tensor([3.0, 4.0]), torch.ones(4, dtype=torch.bfloat16)])
    assert [n.item() for n in norms] == [5.0, 2.0] and norms[1].dtype == torch.float32
    assert not compat.op_schema(torch.ops.aten.add.Tensor).is_mutable
    assert compat.op_schema(torch.ops.aten.add_.Tensor).is_mutable and compat.op_schema(len) is None
    base = torch.zeros(4)
    assert compat.storage_id(base[1:].untyped_storage()) == compat.storage_id(base.untyped_storage())
    assert compat.storage_id(torch.zeros(4).untyped_storage()) != compat.storage_id(base.untyped_storage())
    assert isinstance(compat.tree_leaves(([base], {"a": 1})), list) and compat.tree_flatten([1, 2])[0] == [1, 2]


def test_fallbacks_where_a_public_way_exists(monkeypatch):
    from finetune.testing import tiny_config

    config = tiny_config("llama")
    compat.set_attn_implementation(config, "eager")
    assert compat.attn_implementation(config) == "eager"
    from transformers import LlamaForCausalLM

    assert compat.supports_sdpa(LlamaForCausalLM) and compat.supports_sdpa(None)
    assert compat.supports_sdpa(type("NoFlag", (), {}))  # the attribute gone: sdpa, transformers' own default
    monkeypatch.delattr(torch, "_foreach_norm")
    assert [n.item() for n in compat.foreach_norm([torch.tensor([3.0, 4.0])])] == [5.0]


# Modules a library does not export from its top level: a model's processing helpers, trl's trainer modules,
# peft's internal utilities (compat.PRIVATE names the ones finetune uses)
PRIVATE_MODULE = re.compile(r"transformers\.models\.\w+\.(image_)?processing_\w+|trl\.trainer(\..*)?|peft\.utils\..+")


def _private_uses(path: Path) -> list[str]:
    """Imports of private names or modules from the libraries, and attribute reads of the names compat wraps."""
    wrapped = {name.rsplit(".", 1)[-1] for name in compat.PRIVATE} | {"_model_mapping"}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}" for a in node.names
                      if PRIVATE_MODULE.fullmatch(a.name)]
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            parts = (node.module or "").split(".") + [a.name for a in node.names]
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import ..."
                      for _ in [1] if any(p.startswith("_") for p in parts) or PRIVATE_MODULE.fullmatch(node.module)]
        elif isinstance(node, ast.Attribute) and node.attr in wrapped:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return found


def test_no_module_but_compat_uses_a_private_library_api():
    uses = [use for package in ("finetune", "ui") for path in sorted((ROOT / package).rglob("*.py"))
            if path.name != "compat.py" for use in _private_uses(path)]
    assert uses == []


def _library_overrides(path: Path) -> list[str]:
    """Classes derived from a transformers Trainer or callback, and methods replaced at run time (a bound
    method made with types.MethodType, or an assignment to an object's `step`/`forward`/`backward`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            found += [f"{where}: class {node.name}({b})" for b in bases
                      if b.split(".")[-1] in ("Trainer", "TrainerCallback") or b.endswith("Trainer")]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "MethodType":
            found.append(f"{where}: types.MethodType")
        elif isinstance(node, ast.Assign):
            found += [f"{where}: {ast.unparse(t)} = ..." for t in node.targets
                      if isinstance(t, ast.Attribute) and t.attr in ("step", "forward", "backward", "zero_grad")
                      and ast.unparse(t.value) != "self"]
    return found


# The planner's trace runs an int8 layer's arithmetic on a throwaway model on the `meta` device (no weights, no
# training): the one place a forward is set on an instance, never on a model that trains.
TRACE_ONLY = {"finetune/plan/trace.py"}


def test_no_class_derives_from_the_trainer_and_no_library_method_is_replaced_at_run_time():
    """The training loop is ours (finetune/train/loop.py): nothing in finetune/ or ui/ subclasses
    transformers.Trainer or a TrainerCallback, or swaps an optimizer's or a module's method while running."""
    found = [f for package in ("finetune", "ui") for path in sorted((ROOT / package).rglob("*.py"))
             if str(path.relative_to(ROOT)) not in TRACE_ONLY for f in _library_overrides(path)]
    assert found == []
    sample = ("import types\nclass A(Trainer): pass\nclass B(transformers.TrainerCallback): pass\n"
              "opt.step = types.MethodType(f, opt)\n")
    probe = ROOT / "tests" / "_override_probe.py"
    probe.write_text(sample)
    try:
        assert len(_library_overrides(probe)) == 4  # the check sees each kind
    finally:
        probe.unlink()


def test_a_run_s_accelerator_follows_an_earlier_one_with_other_precision():
    """An Accelerator with bf16 earlier in the process (a TRL trainer, another run) would make accelerate refuse
    the next run's settings; fresh_accelerator_state lets the next one take its own."""
    from accelerate import Accelerator

    compat.fresh_accelerator_state()  # an earlier test of this worker may have set another precision
    Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match="already been initialized"):
        Accelerator(cpu=True, mixed_precision="no")
    compat.fresh_accelerator_state()
    assert Accelerator(cpu=True, mixed_precision="no").mixed_precision == "no"


def test_meta_on_device_reports_the_device_and_holds_nothing():
    """What the planner's trace of LoRA on fused expert weights relies on: the weight says `cpu` (so
    torch.autocast can be opened on its device type), stays disguised as a Parameter and in views, and
    computes plain meta tensors."""
    weight = torch.nn.Parameter(compat.meta_on_device(torch.empty(4, 3, 2, device="meta"), "cpu"),
                                requires_grad=False)
    assert weight.device.type == "cpu" and weight[1].device.type == "cpu"
    with torch.autocast(device_type=weight.device.type, enabled=False):
        out = torch.baddbmm(weight, torch.ones(4, 3, 1, device="meta"), torch.ones(4, 1, 2, device="meta"))
    assert type(out) is torch.Tensor and out.is_meta and out.shape == (4, 3, 2)


def test_the_private_modules_compat_imports_are_fenced_and_work():
    """The fence flags a library module that is not exported from the top level (a model's processing helpers,
    trl's trainer modules, peft's utilities); compat imports the ones finetune uses, each a PRIVATE entry."""
    for name in ("trl.trainer.sft_trainer", "transformers.models.mllama.processing_mllama",
                 "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
                 "peft.utils.transformers_weight_conversion"):
        assert PRIVATE_MODULE.fullmatch(name), name
    assert not PRIVATE_MODULE.fullmatch("transformers.modeling_layers") and not PRIVATE_MODULE.fullmatch("trl")
    assert [n for n in compat.PRIVATE if PRIVATE_MODULE.fullmatch(n.rsplit(".", 1)[0]) or PRIVATE_MODULE.fullmatch(n)]
    assert compat.lm_collator().__name__ == "DataCollatorForLanguageModeling"
    ratios, token_mask, dense = compat.mllama_processing()
    assert ratios(2) == [(1, 1), (1, 2), (2, 1)] and callable(token_mask) and callable(dense)
    assert callable(compat.peft_moe_conversion())
