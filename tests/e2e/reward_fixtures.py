"""Reward functions that tests pass to the flow by import path (`reward.fn=reward_fixtures:...`)."""


def digit_fraction(response: str, answer) -> float:
    """Dense and learnable from scratch: the share of response characters that are digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)
