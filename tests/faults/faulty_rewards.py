"""Reward functions for the fault tests (`reward.fn=faulty_rewards:...`): one that scores, and ones that cannot."""

import time


def share_of_digits(response: str, answer) -> float:
    """Dense from the first step (a random model's completions differ in it): the share of digit characters."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def three_args(response, answer, extra):
    return 1.0


def text(response, answer):
    return "high"


def not_finite(response, answer):
    return float("nan")


def raises(response, answer):
    raise KeyError("no such answer")


def sleeps(response, answer):
    time.sleep(60)
    return 1.0


def fails_unless_right(response, answer):
    """Scores the reference answer (what the check before a run tries), fails on anything else: an untrained
    model's samples mostly cannot be scored."""
    if response.strip() != str(answer):
        raise ValueError(f"cannot parse {response!r}")
    return 1.0


def batched_too_few(prompts, completions, answers, **columns):
    return [1.0] * (len(completions) - 1)
