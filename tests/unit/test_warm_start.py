"""The warm start's references: with a calculator tool, `sft.tool_fraction` of them call it (a seeded draw)."""

import pytest

from m2flow import config as C
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.warm_start import sft_pairs


def product(prompt: str) -> str:
    a, b = prompt.removesuffix("=").split("*")
    return str(int(a) * int(b))


def tool_share(*overrides: str) -> tuple[float, list[tuple[str, str]]]:
    cfg = C.load(ReasoningConfig, "agent_calc", ["data.train_size=400", *overrides])
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
        C.load(ReasoningConfig, "agent_calc", ["sft.tool_fraction=1.5"])


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_sft_target_accuracy_from_the_config_ends_the_warm_start_where_greedy_answers_the_held_back_problems(
        tmp_path, capsys):
    """`sft.target_accuracy` (the demo's): the warm start stops at the first check (every `sft.val_every` steps) at
    which greedy decoding answers that share of `sft.val_size` held-back training problems, which it never trained
    on, says so, and the model it writes answers them that often."""
    from m2flow.engines.hf import init_tiny_model, load_model, load_tokenizer
    from m2flow.engines.train import exact_match
    from m2flow.reasoning.warm_start import sft_model, validation_pairs

    cfg = C.load(ReasoningConfig, "demo", ["model.tiny_hidden=32", "model.tiny_layers=1", "data.digits=1",
                                             "data.train_size=70", "data.eval_size=10", "sft.steps=400",
                                             "sft.target_accuracy=0.5", "sft.val_size=12", "sft.val_every=5",
                                             "data.answer_width=0", "run.progress=false"])
    held_back, pairs = validation_pairs(cfg), sft_pairs(cfg)
    assert len(held_back) == 12 and len(pairs) == 70 and not {p for p, _ in held_back} & {p for p, _ in pairs}
    init = init_tiny_model(tmp_path / "init", hidden_size=32, num_layers=1, seed=0)
    losses = sft_model(str(init), str(tmp_path / "sft"), cfg, progress=False)
    assert 5 <= len(losses) < 400 and len(losses) % 5 == 0
    model, tok = load_model(str(tmp_path / "sft")), load_tokenizer(str(tmp_path / "sft"))
    reached = exact_match(model, tok, held_back)
    assert reached >= 0.5
    assert capsys.readouterr().out.strip() == (f"[m2flow sft] stopped after {len(losses)} of 400 steps: greedy exact "
                                               f"match {reached:.1%} on 12 held-back training problems (reached "
                                               f"sft.target_accuracy=0.5)")
    assert validation_pairs(C.load(ReasoningConfig, "demo", ["sft.target_accuracy=0"])) == []  # no target, none
