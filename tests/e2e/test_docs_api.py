"""docs/api.md's examples run as written (every ```python block, in order, in one namespace)."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_the_api_docs_examples_run(cluster, tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)  # the examples write runs/ where they run
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - the docs' own examples
    out = capsys.readouterr().out
    assert "collocated" in out and "actor.lr" in out
    assert (tmp_path / "runs" / "api_example" / "metrics.jsonl").exists()
