"""docs/architecture.md's layering: imports point downward only. Parses every module's imports with ast."""

import ast
from pathlib import Path

import m2flow

ROOT = Path(m2flow.__file__).parent

# package -> m2flow subpackages it must never import
FORBIDDEN = {
    "runtime": {"algorithms", "engines", "workloads", "workers", "flows", "scheduler", "cli", "reasoning", "config"},
    "algorithms": {"runtime", "engines", "workloads", "workers", "flows", "scheduler", "cli", "config", "reasoning"},
    "engines": {"runtime", "workers", "flows", "scheduler", "cli", "reasoning", "config"},
    "workloads": {"runtime", "workers", "flows", "scheduler", "cli", "reasoning", "config"},
    "scheduler": {"workers", "flows", "cli", "engines", "workloads", "reasoning", "config"},
    "workers": {"flows", "planning", "cli", "api", "demo", "preflight"},
    "planning": {"flows", "cli", "api", "demo", "preflight"},  # chooses the plan with workers and the scheduler
    "flows": {"planning", "cli", "api", "demo", "preflight"},  # a flow gets its plan handed in (api -> plan -> flow)
    "reasoning": {"cli", "api", "demo", "preflight"},  # a recipe's wing: above the core, below the API
}
FLOW_HELPERS = {"outputs"}  # flows/ modules that are not flows: what every flow may import


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


def test_imports_point_downward_only():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        layer = rel[0] if len(rel) > 1 else None
        for target in m2flow_imports(path) & FORBIDDEN.get(layer, set()):
            bad.append(f"{'/'.join(rel)} imports m2flow.{target}")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_no_flow_imports_another_flow():
    """The flows share helpers below them (workers/sync.py, reasoning/warm_start.py) or flows/outputs.py,
    never each other."""
    bad = []
    for path in (ROOT / "flows").glob("*.py"):
        for target in m2flow_imports(path, depth=2):
            package, _, name = target.partition(".")
            if package == "flows" and name not in FLOW_HELPERS | {"", path.stem}:
                bad.append(f"flows/{path.name} imports m2flow.{target}")
    assert not bad, "\n".join(bad)


def test_checker_sees_relative_imports(tmp_path):
    p = ROOT / "runtime" / "_layering_probe.py"
    p.write_text("from ..workers import x\n")
    try:
        assert "workers" in m2flow_imports(p)
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
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("m2flow"):
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
    """Modules that import each other, even lazily (m2flow.api and m2flow.demo once did; reasoning/profiler.py and
    embodied/profiler.py too), cannot be read or moved one at a time."""
    assert import_cycles(module_graph()) == []
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the checker sees one
