"""Imports point down the flow recipe -> build (model/data/optim/memory) -> plan -> train -> api -> cli/ui.

Every module of finetune/ and ui/ is parsed (not imported), so lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("finetune", "ui")

# Lowest first; a module may import its own layer (without a cycle between packages) and the layers below.
LAYERS: list[tuple[str, ...]] = [
    ("finetune", "finetune.recipe", "finetune.units", "finetune.errors", "finetune.console",
     "finetune.rundir", "finetune.testing"),
    ("finetune.compat", "finetune.model", "finetune.data", "finetune.optim", "finetune.memory", "finetune.export",
     "finetune.rl"),
    ("finetune.plan",),
    ("finetune.train", "finetune.evaluate"),
    ("finetune.api",),
    ("finetune.cli", "finetune.cli_tables", "finetune.__main__", "ui"),
]

# Up-pointing imports tolerated while the issue named beside each removes them: (importer, target) by module
# name. Empty now; the test fails when an entry is no longer needed, so the list cannot go stale.
KNOWN_UP: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def package_of(module: str) -> str:
    """The unit a cycle is checked between: a layer entry (finetune.plan, finetune.units, ui)."""
    return max((entry for layer in LAYERS for entry in layer if module == entry or module.startswith(entry + ".")),
               key=len)


def layer_of(module: str) -> int:
    entry = package_of(module)
    return next(i for i, layer in enumerate(LAYERS) if entry in layer)


def _resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The project modules an import statement names (a submodule where `from package import name` is one)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package
            package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}".rstrip(".")
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return sorted({n for n in names if n.split(".")[0] in PACKAGES})


@functools.cache
def project_imports() -> list[tuple[str, int, str]]:
    """(importer, line, target) for every import of a project module, module level or inside functions."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                found += [(module, node.lineno, target) for target in _resolve(module, node)]
    return found


def test_every_module_has_a_layer():
    unplaced = []
    for module in MODULES:
        try:
            layer_of(module)
        except ValueError:
            unplaced.append(module)
    assert not unplaced, f"add these modules to a layer in LAYERS: {unplaced}"


def test_no_import_points_to_a_higher_layer():
    up, used = [], set()
    for importer, line, target in project_imports():
        if layer_of(target) <= layer_of(importer):
            continue
        if (importer, target) in KNOWN_UP:
            used.add((importer, target))
            continue
        up.append(f"{MODULES[importer].relative_to(ROOT)}:{line}: {importer} (layer {layer_of(importer)}) imports "
                  f"{target} (layer {layer_of(target)})")
    assert not up, "imports must point down the layers:\n" + "\n".join(up)
    assert used == KNOWN_UP, f"fixed, remove from KNOWN_UP: {sorted(KNOWN_UP - used)}"


def test_no_cycle_between_packages():
    edges: dict[str, dict[str, tuple[str, int, str]]] = {}
    for importer, line, target in project_imports():
        a, b = package_of(importer), package_of(target)
        if a != b and (importer, target) not in KNOWN_UP:
            edges.setdefault(a, {}).setdefault(b, (importer, line, target))
    cycle = _find_cycle(edges)
    if cycle:
        hops = [edges[a][b] for a, b in zip(cycle, cycle[1:], strict=False)]
        raise AssertionError("import cycle between packages " + " -> ".join(cycle) + ":\n" + "\n".join(
            f"{MODULES[m].relative_to(ROOT)}:{line}: {m} imports {t}" for m, line, t in hops))


def _find_cycle(edges: dict[str, dict[str, tuple]]) -> list[str] | None:
    """A cycle in the graph as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, {}):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_checks_catch_what_they_are_for():
    """The helpers see a lazy import inside a function and a cycle: the two things the tests above exist for."""
    tree = ast.parse("def f():\n    from finetune.train.run import run\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert _resolve("finetune.recipe.schema", node) == ["finetune.train.run"]
    assert layer_of("finetune.train.run") > layer_of("finetune.recipe.schema")
    assert _find_cycle({"a": {"b": ()}, "b": {"c": ()}, "c": {"a": ()}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b": ()}, "b": {"c": ()}}) is None


def test_bottom_layer_imports_no_torch_at_module_level():
    """The recipe schema, units and settings table load where torch is not installed or too slow to import
    (the UI's form, `finetune --help`); torch is imported inside the functions that need it."""
    heavy = []
    for module, path in MODULES.items():
        if layer_of(module) != 0:
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            heavy += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] in ("torch", "transformers")]
    assert not heavy, "\n".join(heavy)


def test_registry_references_point_to_the_build_layer():
    """The registries name code as "module:attribute" strings (imported when a run builds it), which the AST
    scan cannot see: each must name a build-layer module, never plan, train, api or a shell."""
    from finetune.recipe.families import FAMILIES
    from finetune.recipe.methods import METHODS
    from finetune.recipe.offload_tiers import TIERS
    from finetune.recipe.optimizers import SPECS

    references = [(f"optimizer {s.name}", r) for s in SPECS for r in (s.factory, s.state, s.own_params) if r]
    references += [(f"offload tier {t.name}", t.factory) for t in TIERS]
    references += [(f"model family {f.name}", f.experts) for f in FAMILIES if f.experts]
    references += [(f"training method {m.name}", m.loss) for m in METHODS]
    build = layer_of("finetune.model")
    wrong = [f"{owner}: {ref}" for owner, ref in references
             if ref.partition(":")[0] not in MODULES or layer_of(ref.partition(":")[0]) != build]
    assert references and not wrong, f"registry references outside the build layer: {wrong}"
