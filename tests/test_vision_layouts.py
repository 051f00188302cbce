"""One vision kind, one module: how an image becomes tokens lives in finetune/vision/ (one module per layout the
family table names), the rest of the tool calls it without comparing kinds, and Qwen's one resize rule gives the
real processor's grid in the counter, the plan and the run alike."""

from __future__ import annotations

import ast
import json
import pkgutil
from pathlib import Path

import pytest

import finetune.vision
from finetune.recipe.families import FAMILIES
from finetune.vision import ImageLayout, kinds, layout_of

ROOT = Path(__file__).resolve().parents[1]
# the protocol's methods a layout must give itself (the base class has no answer for them)
REQUIRED = ("count", "limit", "grid", "tokens", "trace_inputs", "image_tokens")


def kind_comparisons(source: str) -> list[int]:
    """The lines of `source` that compare something with a vision kind: a layout kind's name as a string, an
    attribute `.kind` of a layout or vision object, or Pixtral's `breaks`."""
    names = set(kinds())

    def suspicious(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and node.value in names:
            return True
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(suspicious(e) for e in node.elts)
        if isinstance(node, ast.Attribute) and node.attr == "kind":
            return any(w in ast.unparse(node.value).lower() for w in ("layout", "vision"))
        if isinstance(node, ast.Attribute):
            return node.attr == "breaks"
        return False

    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
            and any(suspicious(n) for n in (node.left, *node.comparators))]


def test_the_kind_check_finds_the_branches_it_looks_for():
    assert kind_comparisons("if layout.kind == 'gemma3':\n    pass\n") == [1]
    assert kind_comparisons("x = family.vision.kind in ('pixtral', 'mllama')\n") == [1]
    assert kind_comparisons("if self.breaks is not None:\n    pass\n") == [1]
    assert kind_comparisons("if kind == 'pair':\n    pass\n") == []


def test_no_module_outside_finetune_vision_compares_a_vision_kind():
    found = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / "finetune").rglob("*.py"))
             if "vision" not in p.relative_to(ROOT / "finetune").parts[:1]
             and (lines := kind_comparisons(p.read_text()))}
    assert found == {}


def test_every_family_layout_is_one_module_implementing_the_protocol_and_the_docs_say_so():
    modules = {m.name for m in pkgutil.iter_modules(finetune.vision.__path__)}
    named = {f.vision.kind for f in FAMILIES if f.vision is not None}
    assert modules == named == set(kinds())  # no module without a family, no family kind without its module
    seen: set[str] = set()
    for family in FAMILIES:
        if family.vision is None:
            continue
        layout = layout_of(family.vision)
        assert isinstance(layout, ImageLayout), family.name
        missing = [m for m in REQUIRED if getattr(type(layout), m) is getattr(ImageLayout, m)]
        assert not missing, (family.name, missing)
        assert layout.processors and family.vision.image_processor.removesuffix("Pil") in layout.processors
        seen.add(family.vision.kind)
    processors = [p for kind in seen for p in layout_of(next(f.vision for f in FAMILIES if f.vision
                                                              and f.vision.kind == kind)).processors]
    assert len(processors) == len(set(processors))  # each processor counted by one layout
    docs = (ROOT / "docs" / "architecture.md").read_text()
    section = docs.split("**How to add a vision family**", 1)[1].split("\n  - ", 1)[0]
    assert "finetune/vision/" in section and "VisionLayout.kind" in section
    assert all(f"`{m}`" in section for m in REQUIRED)


# Qwen preprocessor configs: keys agreeing, the top-level limit differing from size (the processor's
# constructor takes the top-level one), and size alone (Qwen3-VL's)
QWEN = {
    "agreeing": {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 401408,
                 "size": {"shortest_edge": 3136, "longest_edge": 401408}, "patch_size": 14, "merge_size": 2},
    "top-level first": {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 6272, "max_pixels": 200704,
                        "size": {"shortest_edge": 3136, "longest_edge": 1003520}, "patch_size": 14, "merge_size": 2},
    "size alone": {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 14, "merge_size": 2,
                   "size": {"longest_edge": 802816, "shortest_edge": 3136}},
}


@pytest.mark.parametrize("name", list(QWEN))
def test_qwens_one_resize_rule_is_the_processors_in_the_counter_the_plan_and_the_run(tmp_path, name):
    """A budget above the processor's own limit (10**8) is capped at it everywhere: the plan once took the budget
    as it was and read `size` before the top-level keys, and the run widened the processor's limit to it."""
    from PIL import Image
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from finetune.data.image_tokens import image_inputs, pixel_overrides
    from finetune.data.vision import VisionData
    from finetune.plan.vision import image_grid, image_tokens
    from finetune.recipe.families import family_for

    config = QWEN[name]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    model = Qwen2_5_VLConfig()  # patch 14, merge 2: the configs' own
    layout = family_for("qwen2_5_vl").vision
    for budget in (None, 100_000, 400_000, 10**8):
        loaded = Qwen2VLImageProcessorPil.from_pretrained(tmp_path, **pixel_overrides(config, budget))
        run = VisionData(Qwen2VLImageProcessorPil.from_pretrained(tmp_path), layout, 0, 0, max_pixels=budget)
        for width, height in ((40, 30), (640, 480), (1000, 200), (300, 1200), (2000, 1500)):
            path = tmp_path / f"{width}x{height}.png"
            Image.new("RGB", (width, height), "red").save(path)
            real = tuple(int(x) for x in loaded(Image.open(path), return_tensors="np")["image_grid_thw"][0])
            counted = image_inputs(config, width, height, budget)
            planned = image_grid(model, config, width, height, budget)
            ran = tuple(int(x) for x in run.process([str(path)])["image_grid_thw"][0])
            assert counted.grid == planned == ran == real, (name, budget, width, height)
            assert counted.tokens == image_tokens(model, planned) == run.image_tokens([str(path)])[0]
    assert image_inputs(config, 4000, 3000, 10**8) == image_inputs(config, 4000, 3000, None)


def test_every_layout_counts_without_importing_torch_or_transformers():
    import subprocess
    import sys

    code = ("import sys\nfrom finetune.data.image_tokens import image_tokens\nfrom finetune.vision import layout_of\n"
            "from finetune.recipe.families import FAMILIES\n[layout_of(f.vision) for f in FAMILIES if f.vision]\n"
            "assert image_tokens({'image_processor_type': 'PixtralImageProcessor'}, 640, 480, 100_000) > 0\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
