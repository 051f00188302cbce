"""Imports point down the flow recipe -> build (model/data/optim/memory) -> plan -> train -> api -> cli/ui, and
no module imports itself back through others (no cycle between packages, nor between the modules of a folder).

Every module of finetune/, ui/ and benchmarks/ is parsed (not imported), so lazy imports inside functions and
imports for type checking count too.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("finetune", "ui", "benchmarks")

# Lowest first; a module may import its own layer (without a cycle between packages) and the layers below.
LAYERS: list[tuple[str, ...]] = [
    ("finetune", "finetune.recipe", "finetune.units", "finetune.errors", "finetune.console",
     "finetune.rundir"),
    ("finetune.testing",  # tiny models built as finetune builds any (model.building's lock)
     "finetune.compat", "finetune.model", "finetune.data", "finetune.optim", "finetune.memory", "finetune.export",
     "finetune.rl", "finetune.vision", "finetune.step"),
    ("finetune.plan",),
    ("finetune.train", "finetune.evaluate", "finetune.run_view"),
    ("finetune.api",),
    ("finetune.cli", "finetune.cli_tables", "finetune.__main__", "ui"),
    ("benchmarks",),  # the benchmarks and the GPU kit: users of finetune, used by none of it
]

# Up-pointing imports tolerated while the issue named beside each removes them: (importer, target) by module
# name. Empty now; the test fails when an entry is no longer needed, so the list cannot go stale.
KNOWN_UP: set[tuple[str, str]] = set()

# Module cycles tolerated while the change named beside each removes them, each as its sorted modules. The test
# fails when an entry is no longer a cycle, so the list cannot go stale.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}  # cycles allowed for now, each with why: none


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


def module_cycles(edges: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Every set of modules that import one another round (the graph's strongly connected components of more
    than one module), each sorted (Tarjan's algorithm, iterative: the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            nxt = next(targets, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(edges.get(nxt, {})))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return sorted(found)


def module_edges() -> dict[str, dict[str, tuple[str, int, str]]]:
    """importer -> target -> (importer, line, target) of its first import of it, between distinct modules."""
    edges: dict[str, dict[str, tuple[str, int, str]]] = {}
    for importer, line, target in project_imports():
        if importer != target:
            edges.setdefault(importer, {}).setdefault(target, (importer, line, target))
    return edges


def test_no_cycle_between_modules():
    """No module imports itself back through others, inside a folder or across folders: the shared piece of
    two modules that need each other moves down into a module both import. Each cycle is named hop by hop."""
    edges = module_edges()
    cycles, known = [], set()
    for component in module_cycles(edges):
        if tuple(component) in KNOWN_CYCLES:
            known.add(tuple(component))
            continue
        inside = {a: {b: hop for b, hop in edges.get(a, {}).items() if b in component} for a in component}
        cycle = _find_cycle(inside)
        hops = [edges[a][b] for a, b in zip(cycle, cycle[1:], strict=False)]
        cycles.append("import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(
            f"  {MODULES[m].relative_to(ROOT)}:{line}: {m} imports {t}" for m, line, t in hops))
    assert not cycles, "\n".join(cycles)
    assert known == set(KNOWN_CYCLES), f"no longer a cycle, remove from KNOWN_CYCLES: {set(KNOWN_CYCLES) - known}"


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
    # two folders' modules: a cycle inside each (one of two, one of three) and a module outside any cycle
    graph = {"p.a": {"p.b": ()}, "p.b": {"p.a": (), "q.x": ()}, "q.x": {"q.y": ()}, "q.y": {"q.z": ()},
             "q.z": {"q.x": (), "r": ()}}
    assert module_cycles(graph) == [["p.a", "p.b"], ["q.x", "q.y", "q.z"]]
    assert module_cycles({"a": {"b": ()}, "b": {}}) == []
    type_only = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from finetune.plan import trace\n")
    node = [n for n in ast.walk(type_only) if isinstance(n, ast.ImportFrom)][-1]
    assert _resolve("finetune.plan.planner", node) == ["finetune.plan.trace"]  # an import for type checking counts


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
