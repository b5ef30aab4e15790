"""The warm start's references: with a calculator tool, `sft.tool_fraction` of them call it (a seeded draw)."""

import pytest

from m2flow import config as C
from m2flow.workloads.reasoning.warm_start import sft_pairs


def product(prompt: str) -> str:
    a, b = prompt.removesuffix("=").split("*")
    return str(int(a) * int(b))


def tool_share(*overrides: str) -> tuple[float, list[tuple[str, str]]]:
    cfg = C.load(C.ReasoningConfig, "agent_calc", ["data.train_size=400", *overrides])
    pairs = sft_pairs(cfg)
    return sum("<calc>" in ref for _, ref in pairs) / len(pairs), pairs


def test_tool_fraction_sets_the_share_of_references_that_call_the_calculator():
    everyone, pairs = tool_share()
    assert everyone == 1.0
    prompt, ref = pairs[0]
    answer = product(prompt)
    assert ref == f"<calc>{prompt.removesuffix('=')}</calc><result>{answer}</result>{answer}"
    half, mixed = tool_share("sft.tool_fraction=0.5")
    assert 0.4 < half < 0.6
    direct = [(p, r) for p, r in mixed if "<calc>" not in r]
    assert direct and all(r == product(p) for p, r in direct)  # the bare answer, nothing else
    assert tool_share("sft.tool_fraction=0.5")[1] == mixed  # seeded: the same problems call the tool every time
    assert tool_share("sft.tool_fraction=0")[0] == 0.0
    assert tool_share("agent.tools={}")[0] == 0.0  # no tool: every reference answers directly


def test_tool_fraction_outside_zero_one_is_refused():
    with pytest.raises(C.ConfigError, match=r"sft.tool_fraction must be in \[0, 1\], got 1.5"):
        C.load(C.ReasoningConfig, "agent_calc", ["sft.tool_fraction=1.5"])
