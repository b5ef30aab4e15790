"""Seeded synthetic reasoning tasks (multi-digit arithmetic, countdown) as prompt/answer records, fully offline.

Each record is {"prompt", "answer", "solution"}: `answer` is what the reward checks, `solution` a reference
response for SFT. Train and test splits are disjoint by a hash of the problem, whatever the seed.
Scoring lives in rewards.py; nothing here tokenizes.
"""

from __future__ import annotations

import hashlib
import random
from fractions import Fraction

SPLITS = ("train", "test")
_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
}


def split_of(problem: str, holdout: float) -> str:
    """"test" for a stable `holdout` fraction of problems (by sha256 of the problem text), else "train"."""
    h = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "big") / 2**64
    return "test" if h < holdout else "train"


def _sample_unique(n: int, seed: int, split: str, holdout: float, make, task: str) -> list[dict]:
    """Draw records from make(rng) -> (problem_key, record) until n distinct problems of `split` are found."""
    if split not in SPLITS:
        raise ValueError(f"{task}: split must be one of {SPLITS}, got {split!r}")
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"{task}: holdout must be in (0, 1), got {holdout}")
    rng = random.Random(f"{task}:{seed}:{split}")
    seen: set[str] = set()
    records: list[dict] = []
    attempts, max_attempts = 0, 100 * n + 10_000
    while len(records) < n:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(
                f"{task}: found only {len(records)} distinct {split} problems of the {n} asked for; "
                f"the problem space is too small (use more digits/numbers, a larger holdout, or a smaller n)"
            )
        key, record = make(rng)
        if key in seen or split_of(key, holdout) != split:
            continue
        seen.add(key)
        records.append(record)
    return records


def arithmetic(
    n: int, seed: int = 0, digits: int = 2, ops: str = "+", split: str = "train", holdout: float = 0.1,
    digits_b: int = 0, answer_width: int = 0,
) -> list[dict]:
    """n distinct problems like {"prompt": "37+45=", "answer": "82", "solution": "82", "expression": "37+45"}.

    Operands have exactly `digits` digits (0-9 when digits == 1), the second one `digits_b` if given (123*45 with
    3 and 2); `ops` is any of "+-*". For "-" the larger operand comes first, so answers are never negative.
    An answer shorter than `answer_width` digits is written with leading zeros (3: "082").
    """
    bad = set(ops) - set("+-*")
    if not ops or bad:
        raise ValueError(f"arithmetic: ops must be a non-empty string of '+', '-', '*', got {ops!r}")
    if digits < 1 or digits_b < 0:
        raise ValueError(f"arithmetic: digits must be >= 1 and digits_b >= 0, got {digits} and {digits_b}")
    if answer_width < 0:
        raise ValueError(f"arithmetic: answer_width must be >= 0, got {answer_width}")

    def span(d: int) -> tuple[int, int]:
        return (0 if d == 1 else 10 ** (d - 1)), 10**d - 1

    first, second = span(digits), span(digits_b or digits)

    def make(rng: random.Random):
        a, b, op = rng.randint(*first), rng.randint(*second), rng.choice(ops)
        if op == "-" and a < b:
            a, b = b, a
        prompt = f"{a}{op}{b}="
        answer = str(_OPS[op](a, b)).zfill(answer_width)
        return prompt, {"prompt": prompt, "answer": answer, "solution": answer, "expression": f"{a}{op}{b}"}

    return _sample_unique(n, seed, split, holdout, make, "arithmetic")


def countdown(
    n: int,
    seed: int = 0,
    count: int = 3,
    max_number: int = 20,
    max_target: int = 100,
    ops: str = "+-*",
    split: str = "train",
    holdout: float = 0.1,
) -> list[dict]:
    """n distinct countdown problems: reach the target using each number exactly once with `ops`.

    Record: {"prompt": "3 7 12 -> 33:", "answer": {"numbers": [3, 7, 12], "target": 33},
    "solution": "3*7+12"}. The target is a positive integer <= max_target reached by a random expression
    over the shuffled numbers (left to right, parentheses only where precedence needs them); "/" is
    used only where it divides exactly.
    """
    bad = set(ops) - set(_OPS)
    if not ops or bad:
        raise ValueError(f"countdown: ops must be a non-empty string of '+', '-', '*', '/', got {ops!r}")
    if count < 2 or max_number < 1:
        raise ValueError(f"countdown: need count >= 2 and max_number >= 1, got count={count}, max_number={max_number}")

    def make(rng: random.Random):
        while True:
            numbers = [rng.randint(1, max_number) for _ in range(count)]
            expr, value = _random_expression(numbers, ops, rng)
            if value is not None and value.denominator == 1 and 0 < value <= max_target:
                break
        target = int(value)
        prompt = f"{' '.join(map(str, numbers))} -> {target}:"
        key = f"{sorted(numbers)}->{target}"
        return key, {"prompt": prompt, "answer": {"numbers": numbers, "target": target}, "solution": expr}

    return _sample_unique(n, seed, split, holdout, make, "countdown")


def _random_expression(numbers: list[int], ops: str, rng: random.Random) -> tuple[str, Fraction | None]:
    """Left-to-right expression over a shuffled copy of numbers -> (text, exact value), value None if invalid."""
    order = numbers[:]
    rng.shuffle(order)
    text, value, last = str(order[0]), Fraction(order[0]), None  # last: the outermost op of text
    for x in order[1:]:
        op = rng.choice(ops)
        if op == "/" and (value / x).denominator != 1:
            return text, None
        left = f"({text})" if op in "*/" and last in ("+", "-") else text
        text, value, last = f"{left}{op}{x}", _OPS[op](value, Fraction(x)), op
    return text, value


TASKS = {"arithmetic": arithmetic, "countdown": countdown}


def make_task(name: str, n: int, seed: int = 0, split: str = "train", **kwargs) -> list[dict]:
    """Records of a synthetic task by name ("arithmetic" or "countdown")."""
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name](n, seed=seed, split=split, **kwargs)
