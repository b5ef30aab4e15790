"""The presets ship inside the package: a wheel built from this repository, installed into a fresh virtual
environment, finds `grpo_arithmetic` from a directory outside the repository. `configs/` is a link to them."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert done.returncode == 0, f"{cmd}: {done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_a_wheel_installed_elsewhere_finds_the_presets(tmp_path):
    src = tmp_path / "src"  # a copy of what a wheel is built from, so that the build leaves nothing in the repository
    shutil.copytree(REPO / "m2flow", src / "m2flow", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src)
    (wheel,) = (tmp_path / "dist").glob("m2flow-*.whl")
    fresh = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", fresh)
    python = fresh / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel)
    # the dependencies (torch, ray, ...) come from the test's environment, after the fresh one's own packages
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = run(python, "-c", "import m2flow.config as c; print(c.__file__); print(c.CONFIG_DIR)", cwd=outside).stdout
    assert where.splitlines() == [str(site / "m2flow" / "config.py"), str(site / "m2flow" / "configs")]
    out = run(python, "-m", "m2flow.cli", "train", "grpo_arithmetic", "--help-config", cwd=outside).stdout
    assert "actor.lr" in out and "cluster.placement" in out
    assert sorted(p.name for p in (site / "m2flow" / "configs").glob("*.yaml")) == sorted(
        p.name for p in (REPO / "configs").glob("*.yaml"))


def test_the_configs_folder_is_the_packaged_presets():
    assert (REPO / "configs").resolve() == (REPO / "m2flow" / "configs").resolve()
