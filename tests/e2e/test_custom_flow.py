"""docs/custom_flow.md's example, examples/best_of_n.py (rejection-sampling fine-tuning written as your own flow),
runs under a collocated and a disaggregated plan with the same results, and the doc shows the file as it is."""

import re
import sys
from pathlib import Path

from m2flow import config as C
from m2flow.reasoning.config import ReasoningConfig

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))  # the cluster fixture gives the workers this path too (conftest)
import best_of_n  # noqa: E402


def test_the_example_flow_runs_collocated_and_disaggregated_alike(cluster, tmp_path):
    base = [f"run.dir={tmp_path}", "run.steps=3", "run.progress=false", "sft.steps=0", "data.train_size=200",
            "data.eval_size=20", "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4",
            "actor.micro_batch=8", "actor.lr=1e-2", "reward.fn=reward_fixtures:even_first_char"]
    runs = {}
    for name, placement in (("collocated", "rollout,reward,select,inference,actor: 0"),
                            ("disaggregated", "rollout: 0; reward,select,inference,actor: 1")):
        runs[name] = best_of_n.train(C.load(ReasoningConfig, None, [*base, f"run.name={name}"]), placement, cluster)
    a, b = runs["collocated"], runs["disaggregated"]
    assert len(a) == len(b) == 3
    assert [r["select/kept"] for r in a] == [r["select/kept"] for r in b]
    assert a[0]["reward/mean"] == b[0]["reward/mean"]  # same weights and seeds: the same first samples
    assert any(r["select/kept"] > 0 for r in a)
    for r in a:  # the actor trained on exactly the kept answers: one per kept prompt group
        assert r["actor/samples"] == round(r["select/kept"] * 8)


def test_the_doc_shows_the_example_as_it_is():
    doc = (REPO / "docs" / "custom_flow.md").read_text()
    (shown,) = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert shown == (REPO / "examples" / "best_of_n.py").read_text()
    assert len(shown.splitlines()) <= 80
