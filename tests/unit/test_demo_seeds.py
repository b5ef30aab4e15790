"""`benchmarks/demo_seeds.py`: what it reads off a demo's output, and its table's medians and smallest gain."""

import importlib.util
from pathlib import Path


def _benchmark():
    path = Path(__file__).parents[2] / "benchmarks" / "demo_seeds.py"
    spec = importlib.util.spec_from_file_location("demo_seeds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_gives_each_seed_the_medians_and_the_smallest_gain():
    bench = _benchmark()
    out = ("[m2flow sft] stopped after 970 of 2000 steps: greedy exact match 31.2% on 256 held-back training problems\n"
           "held-out accuracy: 26.0% -> 64.8%\n")
    assert bench.LAST_LINE.search(out).groups() == ("26.0", "64.8")
    assert bench.SFT_LINE.search(out).group(1) == "970"
    rows = [{"seed": s, "before": b, "after": a, "gain": round(a - b, 1), "sft_steps": n, "wall_s": w, "load": 1.0}
            for s, b, a, n, w in [(0, 32.6, 94.0, 270, 191), (1, 26.0, 64.8, 970, 264), (2, 29.4, 50.6, 1350, 286)]]
    lines = bench.table(rows).splitlines()
    assert lines[2] == "| 0 | 32.6% | 94.0% | +61.4 | 270 | 191 | 1.00 |"
    assert lines[5] == "| **median** | **29.4%** | **64.8%** | **+38.8** | | **264** | |"
    assert lines[6] == "smallest gain +21.2 points (seed 2)"
