"""Reward functions that tests pass to the flow by import path (`reward.fn=reward_fixtures:...`)."""


def digit_fraction(response: str, answer) -> float:
    """Dense and learnable from scratch: the share of response characters that are digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def even_first_char(response: str, answer) -> float:
    """About half of a random model's greedy answers pass: 1 when the first character's code is even."""
    return float(bool(response) and ord(response[0]) % 2 == 0)


def sums_checked(prompts, completions, answers):
    """Batched (TRL-style): 1 for every completion whose prompt 'a+b=' and answer agree, so a mean reward of 1 says
    that prompts, completions and answers arrived aligned."""
    return [float(eval(p.rstrip("="), {}) == int(a)) for p, a in zip(prompts, answers)]  # noqa: S307 - test data


def wrong_count(prompts, completions, answers):
    """Batched, and wrong: one reward too few. Leaves its caller's pid (the reward worker's process) in a file."""
    import os
    import tempfile
    from pathlib import Path

    Path(tempfile.gettempdir(), "m2flow_wrong_count_ppid").write_text(str(os.getppid()))
    return [0.0] * (len(completions) - 1)


def hint_agrees(prompts, completions, answers, hint):
    """Batched, with a dataset column: 1 where the record's `hint` column arrived beside its own answer."""
    return [float(str(h) == str(a)) for h, a in zip(hint, answers)]


GSM8K_ANSWERS = {"apples": "7", "eggs": "60", "earns": "2500"}  # tests/fixtures/gsm8k_sample.jsonl's final answers


def gsm8k_answers(prompts, completions, answers):
    """Batched: 1 where the answer that reached the reward is the number after the fixture question's '####' (commas
    removed), so a mean reward of 1 says that the gsm8k layout read the questions and extracted the answers."""
    expected = [next((a for k, a in GSM8K_ANSWERS.items() if k in p), None) for p in prompts]
    return [float(e is not None and str(a) == e) for e, a in zip(expected, answers)]


MATH_ANSWERS = {"frac{1}{4}": "\\frac{1}{2}", "2^{10}": "1024", "x^2 = 9": "3"}  # tests/fixtures/math_sample.parquet


def math_answers(prompts, completions, answers, level, type):  # noqa: A002 - the fixture's column is named type
    """Batched: 1 where the answer that reached the reward is the content of the fixture solution's last \\boxed{}
    and the file's other columns (level, type) arrived as keyword arguments."""
    expected = [next((a for k, a in MATH_ANSWERS.items() if k in p), None) for p in prompts]
    return [float(e is not None and str(a) == e and lv.startswith("Level") and t == "Algebra")
            for e, a, lv, t in zip(expected, answers, level, type)]


def odd_sums_only(response: str, answer) -> float:
    """No signal for half the prompts: 0 for every response when the sum is even (the whole group scores alike, so
    dynamic sampling drops it), the share of digits in the response when it is odd (groups that vary)."""
    return 0.0 if int(answer) % 2 == 0 else digit_fraction(response, answer)
