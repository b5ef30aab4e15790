"""docs/architecture.md's layering: imports point downward only. Parses every module's imports with ast."""

import ast
from pathlib import Path

import m2flow

ROOT = Path(m2flow.__file__).parent

# Each layer -> the m2flow layers it may import (a layer is a subpackage, or a module at the top of m2flow). The core
# (types, errors, config machinery, runtime, algorithms, engines, planner, run_dir, run) knows no recipe; each recipe's
# wing sits on the core; the front (api, cli, demo, preflight, auto, profiling) may import anything.
TYPES = {"types", "errors"}
CORE_BELOW = {
    "types": set(),
    "errors": set(),
    "config": TYPES,
    "runtime": TYPES,  # cluster, channels, groups: no RL, no config
    "algorithms": {"types"},  # pure tensor math
    "engines": TYPES,  # generation and training engines: plain arguments in
    "planner": TYPES | {"runtime"},  # reads profiles and placements (runtime.placement), never executes
    "run_dir": TYPES | {"config", "runtime"},
    "run": TYPES | {"config", "runtime", "run_dir"},  # the run object every driver hands its bookkeeping to
}
CORE = set(CORE_BELOW)
WINGS = {"reasoning", "embodied"}
FRONT = {"api", "cli", "demo", "preflight", "auto", "profiling", "__init__", "__main__"}
ALLOWED = {**CORE_BELOW, **{wing: CORE for wing in WINGS}}


def m2flow_imports(path: Path, depth: int = 1) -> set[str]:
    """The m2flow modules `path` imports, named to `depth` parts below m2flow (1: `flows`; 2: `flows.reasoning`)."""
    tree = ast.parse(path.read_text())
    pkg = path.relative_to(ROOT).parts
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the module's package
                base = list(pkg[:-1])[: len(pkg) - node.level]
                mod = ".".join(["m2flow", *base, *(node.module.split(".") if node.module else [])])
                names = [mod]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "m2flow" and len(parts) > 1:
                out.add(".".join(parts[1 : 1 + depth]))
    return out


def layer_of(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0] if len(rel) > 1 else path.stem


def test_every_module_has_a_layer():
    """A new package or top-level module is placed in the core, a wing or the front before it lands."""
    unknown = sorted({layer_of(p) for p in ROOT.rglob("*.py")} - CORE - WINGS - FRONT)
    assert not unknown, f"modules in no layer of this test: {unknown}"


def test_imports_point_downward_only():
    bad = []
    for path in ROOT.rglob("*.py"):
        layer = layer_of(path)
        if layer in FRONT:
            continue
        for target in m2flow_imports(path) - ALLOWED[layer] - {layer}:
            bad.append(f"{path.relative_to(ROOT)} ({layer}) imports m2flow.{target}")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_the_core_imports_no_wing_and_the_wings_not_each_other():
    """The same rule as above, said as the house's: a change to one recipe touches one wing. The flows share what is
    below them (runtime/sync.py, run_dir.py), never each other."""
    bad = []
    for path in ROOT.rglob("*.py"):
        layer = layer_of(path)
        if layer in FRONT:
            continue
        for target in m2flow_imports(path) & (WINGS - {layer}):
            bad.append(f"{path.relative_to(ROOT)} ({layer}) imports the {target} wing")
    assert not bad, "\n".join(bad)
    assert "reasoning" not in ALLOWED["embodied"] and "embodied" not in ALLOWED["reasoning"]


def test_checker_sees_relative_imports(tmp_path):
    p = ROOT / "runtime" / "_layering_probe.py"
    p.write_text("from ..embodied import x\n")
    try:
        assert "embodied" in m2flow_imports(p)
    finally:
        p.unlink()


def module_graph() -> dict[str, set[str]]:
    """Every m2flow module -> the m2flow modules it imports (at the top or inside a function: a lazy import is a
    dependence too); `from pkg import name` counts as importing module pkg.name where that is one, else pkg. A
    package's __init__ re-exporting its own submodules does not make the package depend on them."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = ("m2flow", *path.relative_to(ROOT).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str:
        while name not in names:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in names.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: resolved against this module's package
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                out |= {known(f"{base}.{a.name}") for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("m2flow"):
                out |= {known(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                out |= {known(a.name) for a in node.names if a.name.startswith("m2flow")}
        own = path.name == "__init__.py"
        graph[name] = {o for o in out if o != name and not (own and o.startswith(f"{name}."))}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    """Modules that import each other, even lazily (m2flow.api and m2flow.demo once did; so did the two profilers
    when they lived in planning/), cannot be read or moved one at a time."""
    graph = module_graph()
    assert import_cycles(graph) == []
    assert "m2flow.embodied.envs.maniskill" in graph["m2flow.embodied.policies"]  # a lazy relative import counts
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the checker sees one


def test_each_wings_driver_reads_like_the_algorithm_box():
    """A wing's flow.py stays a driver (<= 150 lines) and its step loop (`for step in ...`) short (<= 40 lines):
    what is not the algorithm lives in the run object, the weight sync, the channels and the wing's steps.py."""
    for wing in sorted(WINGS):
        path = ROOT / wing / "flow.py"
        tree = ast.parse(path.read_text())
        loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and getattr(n.target, "id", None) == "step"]
        assert len(path.read_text().splitlines()) <= 150, f"{wing}/flow.py is over 150 lines"
        assert len(loops) == 1 and loops[0].end_lineno - loops[0].lineno + 1 <= 40, \
            f"{wing}/flow.py: one step loop of at most 40 lines, got {[n.end_lineno - n.lineno + 1 for n in loops]}"
