"""Reward functions for the fault tests (`reward.fn=faulty_rewards:...`)."""


def share_of_digits(response: str, answer) -> float:
    """Dense from the first step (a random model's completions differ in it): the share of digit characters."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)
