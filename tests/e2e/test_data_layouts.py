"""`data.layout` reaches a run: a GSM8K-layout JSONL file trains with its questions as prompts and the numbers
after '####' as answers, scored by math_verify; a MATH-layout Parquet file with its problems and the contents of each
solution's last \\boxed{} (issue 15)."""

import json
from pathlib import Path

import pytest

from m2flow import config as C
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.flow import train

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GSM8K = FIXTURES / "gsm8k_sample.jsonl"  # 3 questions, one answer "2,500"


def run(cluster, tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.trace=false", "run.steps=2",
            "cluster.placement=rollout,reward,inference,actor: 0-1:0", "data.task=file", f"data.path={GSM8K}",
            "data.max_prompt_len=128", "data.eval_size=1", "rollout.prompts_per_step=2", "rollout.n=2",
            "rollout.max_new_tokens=4", *overrides]
    train(C.load(ReasoningConfig, None, base), cluster)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_a_gsm8k_layout_file_trains_on_its_questions_and_extracted_answers(cluster, tmp_path):
    rows = run(cluster, tmp_path, "gsm8k", "data.layout=gsm8k", "reward.fn=reward_fixtures:gsm8k_answers")
    assert [r["reward/mean"] for r in rows] == [1.0, 1.0]  # every prompt arrived with its extracted answer

    scored = run(cluster, tmp_path, "verify", "data.layout=gsm8k")  # reward.fn auto: math_verify for a file
    assert all(r["reward/errors"] == 0 and r["reward/timeouts"] == 0 and 0 <= r["reward/mean"] <= 1 for r in scored)
    assert all(r["actor/samples"] == 4 for r in scored)

    with pytest.raises(ValueError, match=r"missing column\(s\) \['prompt'\]; columns found: \['answer', 'question'\]"):
        run(cluster, tmp_path, "plain", "data.layout=plain", "run.overwrite=true")


def test_a_math_layout_file_trains_on_its_problems_and_boxed_answers(cluster, tmp_path):
    rows = run(cluster, tmp_path, "math", f"data.path={FIXTURES / 'math_sample.parquet'}", "data.layout=math",
               "reward.fn=reward_fixtures:math_answers")
    assert [r["reward/mean"] for r in rows] == [1.0, 1.0]  # answers extracted, level and type passed along
