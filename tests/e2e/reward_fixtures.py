"""Reward functions that tests pass to the flow by import path (`reward.fn=reward_fixtures:...`)."""


def digit_fraction(response: str, answer) -> float:
    """Dense and learnable from scratch: the share of response characters that are digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def even_first_char(response: str, answer) -> float:
    """About half of a random model's greedy answers pass: 1 when the first character's code is even."""
    return float(bool(response) and ord(response[0]) % 2 == 0)
