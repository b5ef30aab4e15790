"""Synthetic tasks, dataset loading (JSONL/Parquet, GSM8K/MATH layouts) and PromptDataset epochs/resume."""

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from m2flow.engines.hf import build_char_tokenizer
from m2flow.reasoning.tasks.data import PromptDataset, last_boxed, load_dataset
from m2flow.reasoning.tasks.rewards import countdown_reward
from m2flow.reasoning.tasks.synthetic import arithmetic, countdown, make_task, split_of

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


# ---------------------------------------------------------------------------------------------- synthetic


def test_arithmetic_is_seeded_correct_and_splits_are_disjoint():
    train = arithmetic(3000, seed=0, digits=2, ops="+-*")
    assert train == arithmetic(3000, seed=0, digits=2, ops="+-*")
    assert train != arithmetic(3000, seed=1, digits=2, ops="+-*")
    test = arithmetic(300, seed=0, digits=2, ops="+-*", split="test")
    other_seed_train = arithmetic(3000, seed=7, digits=2, ops="+-*")
    test_prompts = {r["prompt"] for r in test}
    assert not test_prompts & {r["prompt"] for r in train + other_seed_train}
    assert len({r["prompt"] for r in train}) == len(train)
    for r in train + test:
        a, op, b = r["prompt"][:2], r["prompt"][2], r["prompt"][3:5]
        assert r["prompt"].endswith("=") and len(r["prompt"]) == 6
        assert r["answer"] == r["solution"] == str(eval(f"{a}{op}{b}")) and int(r["answer"]) >= 0
        assert split_of(r["prompt"], 0.1) == ("test" if r in test else "train")


def test_arithmetic_operands_can_have_different_lengths():
    recs = arithmetic(500, seed=0, digits=3, digits_b=2, ops="*-")
    for r in recs:
        a, b = r["expression"].replace("-", "*").split("*")
        assert (len(a), len(b)) == (3, 2) and r["prompt"] == r["expression"] + "="
        assert r["answer"] == str(eval(r["expression"])) and int(r["answer"]) >= 0
    assert {r["expression"][3] for r in recs} == {"*", "-"}


def test_arithmetic_answers_at_one_width_are_zero_padded_and_the_same_problems():
    """`answer_width` pads shorter answers with leading zeros (the demo's 3: 37+45=082) and changes nothing else:
    the same prompts in the same order, the reward checks the padded answer."""
    from m2flow.reasoning.tasks.rewards import exact_match

    plain, padded = arithmetic(300, seed=0), arithmetic(300, seed=0, answer_width=3)
    assert [r["prompt"] for r in padded] == [r["prompt"] for r in plain]
    for p, q in zip(plain, padded):
        assert len(q["answer"]) == 3 and int(q["answer"]) == int(p["answer"]) and q["solution"] == q["answer"]
    short = next(q for q in padded if q["answer"].startswith("0"))
    assert exact_match(short["answer"], short["answer"]) == 1.0
    assert exact_match(short["answer"].lstrip("0"), short["answer"]) == 0.0
    with pytest.raises(ValueError, match="answer_width must be >= 0, got -1"):
        arithmetic(5, answer_width=-1)


def test_arithmetic_small_space_is_a_clear_error():
    with pytest.raises(ValueError, match="too small"):
        arithmetic(50, digits=1, split="test")
    with pytest.raises(ValueError, match="ops"):
        arithmetic(5, ops="^")


def test_countdown_solutions_reach_targets():
    recs = countdown(200, seed=0, count=4, ops="+-*/")
    assert recs == make_task("countdown", 200, seed=0, count=4, ops="+-*/")
    held_out = countdown(50, seed=0, count=4, ops="+-*/", split="test")
    key = lambda r: (sorted(r["answer"]["numbers"]), r["answer"]["target"])
    assert not {str(key(r)) for r in held_out} & {str(key(r)) for r in recs}
    for r in recs + held_out:
        nums, target = r["answer"]["numbers"], r["answer"]["target"]
        assert r["prompt"] == f"{' '.join(map(str, nums))} -> {target}:"
        assert 0 < target <= 100
        assert countdown_reward(r["solution"], r["answer"]) == 1.0


# ---------------------------------------------------------------------------------------------- load_dataset


def test_load_plain_jsonl_and_parquet_agree():
    a = load_dataset(FIXTURES / "plain_sample.jsonl")
    b = load_dataset(FIXTURES / "plain_sample.parquet")
    assert a == b and a[0] == {"prompt": "12+34=", "answer": "46", "columns": {}} and len(a) == 5


def test_load_gsm8k_layout_extracts_final_answer():
    recs = load_dataset(FIXTURES / "gsm8k_sample.jsonl", layout="gsm8k")
    assert [r["answer"] for r in recs] == ["7", "60", "2500"]
    assert recs[0]["prompt"].startswith("Tom has") and recs[0]["solution"].endswith("#### 7")


def test_load_math_layout_extracts_boxed():
    recs = load_dataset(FIXTURES / "math_sample.parquet", layout="math")
    assert [r["answer"] for r in recs] == ["\\frac{1}{2}", "1024", "3"]
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{2}{3}} end") == "\\frac{2}{3}"
    assert last_boxed("no box") is None


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['prompt'\]; columns found: \['answer', 'question'\]"):
        load_dataset(FIXTURES / "gsm8k_sample.jsonl")
    pq.write_table(pa.Table.from_pylist([{"q": "x", "a": "1"}]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: missing column\(s\) \['prompt', 'answer'\]; columns found: \['a', 'q'\]"):
        load_dataset(tmp_path / "bad.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: the dataset is empty"):
        load_dataset(tmp_path / "empty.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match="broken.jsonl:2: invalid JSON"):
        load_dataset(tmp_path / "broken.jsonl")
    (tmp_path / "nomark.jsonl").write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="record 0.*####"):
        load_dataset(tmp_path / "nomark.jsonl", layout="gsm8k")
    (tmp_path / "corrupt.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="corrupt.parquet: not a readable Parquet file"):
        load_dataset(tmp_path / "corrupt.parquet")
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_dataset(tmp_path / "data.csv")


# ---------------------------------------------------------------------------------------------- PromptDataset


def test_prompt_dataset_drops_long_prompts(tok, caplog):
    recs = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "x" * 50, "answer": "?"}, {"prompt": "22+22=", "answer": "44"}]
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset(recs, tok, max_prompt_len=10, seed=0)
    assert ds.dropped == 1 and len(ds) == 2
    assert "dropped 1 of 3 prompts" in caplog.text
    assert [it["prompt_ids"] for it in ds.items] == [tok("1+1=")["input_ids"], tok("22+22=")["input_ids"]]
    assert [it["index"] for it in ds.items] == [0, 2] and ds.items[1]["answer"] == "44"
    with pytest.raises(ValueError, match=r"all 3 prompts are longer than max_prompt_len=3 tokens \(longest: 50\)"):
        PromptDataset(recs, tok, max_prompt_len=3)


def test_prompt_dataset_chat_template(tok):
    recs = [{"prompt": "1+1=", "answer": "2"}]
    assert PromptDataset(recs, tok, 64).items[0]["prompt_ids"] == tok("1+1=")["input_ids"]  # auto: no template
    with pytest.raises(ValueError, match="no chat template"):
        PromptDataset(recs, tok, 64, use_chat_template=True)
    chat_tok = build_char_tokenizer()
    chat_tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    ds = PromptDataset(recs, chat_tok, 64)
    assert chat_tok.decode(ds.items[0]["prompt_ids"]) == "<user>1+1=\n<assistant>"
    assert PromptDataset(recs, chat_tok, 64, use_chat_template=False).items[0]["prompt_ids"] == tok("1+1=")["input_ids"]


def test_next_batch_epochs_and_resume(tok):
    recs = arithmetic(10, seed=0)
    ds = PromptDataset(recs, tok, 16, seed=3)
    epoch0 = [it["index"] for it in ds.next_batch(10)]
    assert sorted(epoch0) == list(range(10))
    cross = [it["index"] for it in ds.next_batch(7)] + [it["index"] for it in ds.next_batch(7)]
    assert sorted(cross[:10]) == list(range(10)) and ds.epoch == 2 and ds.cursor == 4
    assert cross[:10] != epoch0  # reshuffled per epoch

    a = PromptDataset(recs, tok, 16, seed=3)
    a.next_batch(13)
    state = json.loads(json.dumps(a.state_dict()))  # survives a checkpoint round trip
    expected = [it["index"] for it in a.next_batch(25)]
    b = PromptDataset(recs, tok, 16, seed=3)
    b.load_state_dict(state)
    assert [it["index"] for it in b.next_batch(25)] == expected
    with pytest.raises(ValueError, match="size=10, seed=3"):
        PromptDataset(recs[:5], tok, 16, seed=3).load_state_dict(state)
    unshuffled = PromptDataset(recs, tok, 16, shuffle=False)
    assert [it["index"] for it in unshuffled.next_batch(12)] == [*range(10), 0, 1]
