"""Built-in rewards, reward functions by import path, and RewardRunner's timeouts and error counting."""

import logging
import threading
import time

import pytest

from m2flow.engines.hf import build_char_tokenizer
from m2flow.reasoning.tasks.rewards import (
    RewardRunner,
    completion_text,
    countdown_reward,
    exact_match,
    load_reward_fn,
    math_verify_reward,
)


# Module-level so that reward worker processes can import them by reference.
def flaky_reward(response, answer):
    if response == "raise":
        raise RuntimeError("user reward blew up")
    if response == "hang":
        time.sleep(60)
    return float(response == answer)


def _failure_logs(caplog) -> int:
    return sum("failed (scored 0" in r.getMessage() for r in caplog.records)


def test_exact_match():
    assert exact_match("82", "82") == 1.0
    assert exact_match("  82 \n", 82) == 1.0
    assert exact_match("82<eos>", "82") == 1.0
    assert exact_match("82<eos><pad><pad>", "82") == 1.0
    assert exact_match("82<|im_end|>garbage", "82") == 1.0
    assert exact_match("83", "82") == 0.0
    assert exact_match("820", "82") == 0.0
    assert exact_match("", "82") == 0.0
    assert exact_match("the answer is 82", "82") == 0.0


def test_a_completion_is_scored_on_its_generated_tokens_up_to_the_stop_token():
    """Special tokens the model wrote inside its answer stay in the text (a reward hack otherwise: `1<pad>57` read as
    `157`); the stop token and what follows it are cut."""
    tok = build_char_tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos, pad = tok.eos_token_id, tok.pad_token_id
    hacked = completion_text(tok, ids("1") + [pad] + ids("57") + [eos], [eos])
    assert hacked == "1<pad>57" and exact_match(hacked, 157) == 0.0
    clean = completion_text(tok, ids("157") + [eos] + ids("99"), [eos])
    assert clean == "157" and exact_match(clean, 157) == 1.0
    assert completion_text(tok, ids("15"), [eos]) == "15"  # cut by the length limit: no stop token


def test_math_verify():
    assert math_verify_reward("so \\boxed{1/2}", "0.5") == 1.0
    assert math_verify_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_verify_reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert math_verify_reward("The answer is $\\boxed{1024}$.", "1024") == 1.0
    assert math_verify_reward("\\boxed{3}", "0.5") == 0.0
    assert math_verify_reward("no answer here", "0.5") == 0.0
    assert math_verify_reward("", "7") == 0.0


def test_countdown_reward():
    spec = {"numbers": [3, 7, 12], "target": 33}
    assert countdown_reward("3*7+12", spec) == 1.0
    assert countdown_reward("12+7*3<eos>", spec) == 1.0
    assert countdown_reward("(12+7*3)=33", '{"numbers": [3, 7, 12], "target": 33}') == 1.0
    assert countdown_reward("3*7+12+0", spec) == 0.0  # an extra number
    assert countdown_reward("3*11", spec) == 0.0  # wrong numbers
    assert countdown_reward("3*7+11", spec) == 0.0
    assert countdown_reward("7*3", spec) == 0.0  # misses 12
    assert countdown_reward("12/(3-3)+7", {"numbers": [3, 3, 7, 12], "target": 1}) == 0.0  # division by zero
    assert countdown_reward("12/3*7+3", {"numbers": [3, 3, 7, 12], "target": 31}) == 1.0
    assert countdown_reward("__import__('os')", spec) == 0.0
    assert countdown_reward("3**7", spec) == 0.0


def test_load_reward_fn():
    assert load_reward_fn("exact_match") is exact_match
    assert load_reward_fn("math_verify") is math_verify_reward
    assert load_reward_fn("countdown") is countdown_reward
    assert load_reward_fn(f"{__name__}:flaky_reward") is flaky_reward
    with pytest.raises(ValueError, match="not a built-in"):
        load_reward_fn("no_such_reward")
    with pytest.raises(ImportError, match="cannot import module 'no_such_pkg.mod'"):
        load_reward_fn("no_such_pkg.mod:fn")
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        load_reward_fn(f"{__name__}:missing")
    with pytest.raises(TypeError, match="not a callable"):
        load_reward_fn("os:sep")


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_runner_scores_errors_and_timeouts(caplog):
    calls = [("1", "1"), ("raise", "x"), ("2", "3"), ("hang", "x"), ("raise", "y"), ("4", "4")]
    with RewardRunner(flaky_reward, timeout_s=1.0, max_workers=2) as runner:
        runner.score([("warm", "up")] * 2)  # start the worker processes outside the timed part
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            rewards, counts = runner.score(calls)
        elapsed = time.monotonic() - start
        assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert counts == {"timeouts": 1, "errors": 2}
        assert elapsed < 1.0 + 1.5, elapsed
        assert _failure_logs(caplog) == 1 and "user reward blew up" in caplog.text  # first traceback, once
        again, counts = runner.score([("5", "5"), ("raise", "z")])  # the killed worker was replaced
        assert again == [1.0, 0.0] and counts == {"timeouts": 0, "errors": 1}
        assert _failure_logs(caplog) == 1


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_runner_and_math_verify_work_off_the_main_thread():
    out = {}

    def work():  # a Ray actor runs calls in a non-main thread: no signal-based timeouts may be used
        out["inline"] = math_verify_reward("\\boxed{1/2}", "0.5")
        with RewardRunner(flaky_reward, timeout_s=10.0, max_workers=1) as runner:
            out["runner"] = runner.score([("1", "1"), ("raise", "x")])

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=60)
    assert out == {"inline": 1.0, "runner": ([1.0, 0.0], {"timeouts": 0, "errors": 1})}


def test_runner_inline_and_bad_functions():
    rewards, counts = RewardRunner(flaky_reward, timeout_s=None).score([("1", "1"), ("raise", "")])
    assert rewards == [1.0, 0.0] and counts == {"timeouts": 0, "errors": 1}
    with pytest.raises(TypeError, match="cannot be sent to a worker process"):
        RewardRunner(lambda r, a: 1.0, timeout_s=1.0)
    rewards, counts = RewardRunner(lambda r, a: float("nan"), timeout_s=None).score([("1", "1")])
    assert rewards == [0.0] and counts["errors"] == 1


def batched_lengths(prompts, completions, answers, **columns):
    hints = columns.get("hint", [0] * len(completions))
    return [len(c) + (p == "q") + (a == 1) + 10 * h for p, c, a, h in zip(prompts, completions, answers, hints)]


def batched_raises(prompts, completions, answers):
    raise RuntimeError("batched reward blew up")


def batched_short(prompts, completions, answers):
    return [1.0] * (len(completions) - 1)


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_batched_reward_functions_are_told_apart_and_called_once(timeout_s):
    """TRL's form, fn(prompts, completions, answers, **kw) -> list, is one call for the batch; (response, answer)
    functions stay per completion; a batched call that raises scores all 0 (counted once); a wrong count raises."""
    from m2flow.reasoning.tasks.rewards import is_batched

    assert is_batched(batched_lengths) and not is_batched(exact_match)
    with RewardRunner(batched_lengths, timeout_s=timeout_s) as runner:
        scores, counts = runner.score_texts(["q", "r"], ["ab", "abcd"], [1, 2])
    assert scores == [4.0, 4.0] and counts == {"timeouts": 0, "errors": 0}
    with RewardRunner(batched_lengths, timeout_s=timeout_s) as runner:  # each dataset column as a keyword argument
        assert runner.score_texts(["q", "r"], ["ab", "abcd"], [1, 2], [{"hint": 1}, {"hint": 2}])[0] == [14.0, 24.0]
    with RewardRunner(exact_match, timeout_s=timeout_s) as runner:
        assert runner.score_texts(["q", "q"], ["82", "83"], [82, 82])[0] == [1.0, 0.0]
    with RewardRunner(batched_raises, timeout_s=timeout_s) as runner:
        assert runner.score_texts(["q"] * 3, ["1", "2", "3"], [1, 2, 3]) == ([0.0] * 3, {"timeouts": 0, "errors": 1})
    with RewardRunner(batched_short, timeout_s=timeout_s) as runner:
        with pytest.raises(ValueError, match=r"test_rewards:batched_short \(batched\) returned 2 rewards for 3"):
            runner.score_texts(["q"] * 3, ["1", "2", "3"], [1, 2, 3])
