"""docs/architecture.md's layering: imports point downward only. Parses every module's imports with ast."""

import ast
from pathlib import Path

import m2flow

ROOT = Path(m2flow.__file__).parent

# package -> m2flow subpackages it must never import
FORBIDDEN = {
    "runtime": {"algorithms", "engines", "workloads", "workers", "flows", "scheduler", "cli"},
    "algorithms": {"runtime", "engines", "workloads", "workers", "flows", "scheduler", "cli", "config"},
    "engines": {"runtime", "workers", "flows", "scheduler", "cli"},
    "workloads": {"runtime", "workers", "flows", "scheduler", "cli"},
    "scheduler": {"workers", "flows", "cli", "engines", "workloads"},
    "workers": {"flows", "planning", "cli", "api", "demo", "preflight"},
    "planning": {"flows", "cli", "api", "demo", "preflight"},  # chooses the plan with workers and the scheduler
    "flows": {"planning", "cli", "api", "demo", "preflight"},  # a flow gets its plan handed in (api -> plan -> flow)
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
    """The flows share helpers below them (workers/sync.py, workloads/reasoning/warm_start.py) or flows/outputs.py,
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
