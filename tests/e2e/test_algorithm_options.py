"""Each algorithm option of the reasoning flow, reached from the config in a real run, changes what it should
(issue 15): the advantage estimators, GSPO's sequence-level ratio, dual-clip and the entropy bonus."""

import json

import pytest

from m2flow import config as C
from m2flow.reasoning.config import ReasoningConfig
from m2flow.reasoning.flow import train

COLLOCATED = ["cluster.placement=rollout,reward,inference,actor: 0-1:0", "reward.fn=reward_fixtures:digit_fraction"]


def run(cluster, tmp_path, name, *overrides):
    base = [f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false", "run.trace=false", "run.steps=2",
            "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=4", "actor.lr=1e-3",
            "data.train_size=200", "data.eval_size=20", *COLLOCATED]
    train(C.load(ReasoningConfig, None, base + list(overrides)), cluster)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_advantage_estimators_score_the_same_samples_differently(cluster, tmp_path):
    """The first step samples the same responses under every estimator (same seed, same start model), so the
    rewards agree and only the advantages differ: RLOO's are k/(k-1) times Dr.GRPO's (the mean of the others instead
    of the group mean, no std), and GRPO divides by the group's std."""
    got = {a: run(cluster, tmp_path, a, f"algorithm.advantage={a}", "run.steps=1")[0]
           for a in ("grpo", "dr_grpo", "rloo")}
    assert got["grpo"]["reward/mean"] == got["dr_grpo"]["reward/mean"] == got["rloo"]["reward/mean"]
    dr, rloo, grpo = (got[a]["advantage/abs_mean"] for a in ("dr_grpo", "rloo", "grpo"))
    assert dr > 0
    assert rloo == pytest.approx(dr * 4 / 3, rel=1e-5)  # groups of k = 4
    assert grpo > 2 * dr  # rewards in [0, 1] spread by well under 0.5 within a group: dividing by the std enlarges


def test_gspo_gives_every_token_of_a_response_one_ratio(cluster, tmp_path):
    """With 2 epochs the second pass sees ratios away from 1. PPO's differ token by token inside a response; GSPO
    (`algorithm.policy_loss=gspo`) gives each response the exp of its mean token log-ratio, so the spread inside a
    response is 0, and its paper's tight clip range clips far more tokens than PPO's 0.2 / 0.28."""
    common = ["actor.epochs=2", "algorithm.old_logprobs=recompute"]
    ppo = run(cluster, tmp_path, "ppo", *common)
    gspo = run(cluster, tmp_path, "gspo", *common, "algorithm.policy_loss=gspo", "algorithm.clip_low=3e-4",
               "algorithm.clip_high=4e-4", "algorithm.loss_agg=seq-mean-token-mean")
    assert all(r["actor/ratio_spread"] > 0 for r in ppo)
    assert all(r["actor/ratio_spread"] == 0 for r in gspo)
    assert sum(r["actor/clipfrac"] for r in gspo) > sum(r["actor/clipfrac"] for r in ppo)
    assert all(r["actor/clipfrac"] > 0 for r in gspo)
    with pytest.raises(C.ConfigError, match="algorithm.policy_loss must be ppo | gspo, got 'gpo'"):
        C.load(ReasoningConfig, None, ["algorithm.policy_loss=gpo"])


def test_dual_clip_caps_negative_advantage_tokens_whose_ratio_rose(cluster, tmp_path):
    """`algorithm.dual_clip=c`: a token with a negative advantage whose ratio exceeds c has its loss capped at -A c
    (no gradient). With c just above 1, the second epoch finds such tokens; without the option none is counted."""
    common = ["actor.epochs=2", "actor.mini_batches=2", "algorithm.old_logprobs=recompute", "run.steps=3"]
    capped = run(cluster, tmp_path, "dual", *common, "algorithm.dual_clip=1.0001")
    plain = run(cluster, tmp_path, "plain", *common)
    assert sum(r["actor/dual_clipfrac"] for r in capped) > 0
    assert all(r["actor/dual_clipfrac"] == 0 for r in plain)
    assert capped[0]["reward/mean"] == plain[0]["reward/mean"]  # the same first samples: the option made the change
    assert capped[-1]["actor/pg_loss"] != plain[-1]["actor/pg_loss"]


def test_entropy_bonus_raises_the_policys_entropy(cluster, tmp_path):
    """`algorithm.entropy_coef` subtracts coef x entropy from the loss: a large bonus drives the sampling entropy up
    step by step, above the same run without it."""
    common = ["run.steps=4"]
    bonus = run(cluster, tmp_path, "bonus", *common, "algorithm.entropy_coef=1.0")
    plain = run(cluster, tmp_path, "plain", *common)
    assert bonus[0]["actor/entropy"] == pytest.approx(plain[0]["actor/entropy"], rel=1e-4)  # the same start
    assert bonus[-1]["actor/entropy"] > plain[-1]["actor/entropy"]
    assert bonus[-1]["actor/entropy"] > bonus[0]["actor/entropy"]


def test_overlong_penalty_takes_reward_from_responses_near_the_length_limit(cluster, tmp_path):
    """`algorithm.overlong_buffer=N`: a response of L tokens (eos included) loses overlong_penalty x (L - (max - N)) /
    N of its reward past max - N tokens. With N = max_new_tokens = 4 every response loses L / 4: the step's mean
    penalty is minus its mean length over 4. The task reward (`reward/mean`) is reported before the penalty, the
    scores the advantages are made of (`reward/shaped_mean`) after it."""
    penalized = run(cluster, tmp_path, "penalized", "algorithm.overlong_buffer=4", "run.steps=1")[0]
    plain = run(cluster, tmp_path, "plain", "run.steps=1")[0]
    assert penalized["reward/overlong_penalty"] == pytest.approx(-penalized["response/length_mean"] / 4, rel=1e-6)
    assert penalized["reward/overlong_penalty"] < 0 and plain["reward/overlong_penalty"] == 0
    assert penalized["reward/mean"] == plain["reward/mean"]  # the same samples
    shaped = penalized["reward/mean"] + penalized["reward/overlong_penalty"]
    assert penalized["reward/shaped_mean"] == pytest.approx(shaped)
    assert plain["reward/shaped_mean"] == pytest.approx(plain["reward/mean"])  # what the advantages are made of
    with pytest.raises(C.ConfigError, match=r"overlong_buffer must be in \[0, rollout.max_new_tokens = 4\], got 5"):
        C.load(ReasoningConfig, None, ["rollout.max_new_tokens=4", "algorithm.overlong_buffer=5"])


def test_overlong_filter_trains_only_on_responses_that_stopped(cluster, tmp_path):
    """`algorithm.overlong_filter`: responses cut at rollout.max_new_tokens (no eos) get no gradient. With 2 new
    tokens the untrained model stops early in few responses: the filtered share is the truncated share."""
    rows = run(cluster, tmp_path, "filtered", "algorithm.overlong_filter=true", "rollout.max_new_tokens=2")
    for r in rows:
        assert r["response/truncated_frac"] > 0.5
        assert r["actor/overlong_filtered"] == pytest.approx(r["response/truncated_frac"], abs=1e-6)
    assert "actor/overlong_filtered" not in run(cluster, tmp_path, "plain", "rollout.max_new_tokens=2")[0]


@pytest.mark.parametrize("placement", ["rollout,reward,inference,actor: 0-1:0", "rollout: 0; reward,inference,actor: 1"])
def test_reinforce_pp_whitens_the_group_centred_scores_over_the_steps_tokens(cluster, tmp_path, placement):
    """`algorithm.advantage=reinforce_pp` (REINFORCE++ with a group baseline): the reward stage sends each response's
    score minus its group's mean (Dr.GRPO's advantage), and the actor, once the step's data has all arrived, whitens
    them over every valid token of the step: token-weighted mean 0, std 1."""
    rows = run(cluster, tmp_path, "rpp", "algorithm.advantage=reinforce_pp", f"cluster.placement={placement}")
    centred = run(cluster, tmp_path, "dr", "algorithm.advantage=dr_grpo", "run.steps=1")[0]
    assert rows[0]["advantage/abs_mean"] == pytest.approx(centred["advantage/abs_mean"], rel=1e-6)
    for r in rows:
        assert abs(r["actor/advantage_token_mean"]) < 1e-6
        assert r["actor/advantage_token_std"] == pytest.approx(1.0, abs=0.02)  # Bessel's n/(n-1) over ~100 tokens


@pytest.mark.parametrize("epochs", [1, 2])
def test_dynamic_sampling_that_drops_every_group_makes_no_update(cluster, tmp_path, epochs):
    """`algorithm.dynamic_sampling`: a group whose rewards are all equal carries no signal and is dropped. The
    untrained model answers no sum right (exact match scores 0 everywhere), so every group goes: the step learns
    from nothing, whether the actor streams (1 epoch) or collects the whole batch (2 epochs), and the run goes on."""
    rows = run(cluster, tmp_path, f"dropped{epochs}", "algorithm.dynamic_sampling=true", "reward.fn=exact_match",
               f"actor.epochs={epochs}")
    for r in rows:
        assert (r["reward/groups_dropped"], r["reward/groups_kept"], r["actor/samples"]) == (8, 0, 0)


@pytest.mark.parametrize("placement", ["rollout,reward,inference,actor: 0-1:0", "rollout: 0; reward,inference,actor: 1"])
def test_dynamic_sampling_refills_the_step_with_groups_whose_rewards_differ(cluster, tmp_path, placement):
    """`algorithm.refill_rounds=N`: `odd_sums_only` gives no signal for even sums, so dynamic sampling drops about
    half of every round's groups. Without refill a step trains on the groups left; with it, rounds of 8 fresh prompts
    run until 8 groups are kept, and every step trains on exactly 8 x 4 samples. The groups beyond 8 in the last round
    are surplus, never sent. Collocated (stages in one process, in turn) and pipelined (streaming) alike."""
    common = ["algorithm.dynamic_sampling=true", "reward.fn=reward_fixtures:odd_sums_only", "run.steps=3",
              f"cluster.placement={placement}"]
    plain = run(cluster, tmp_path, "plain", *common)
    full = run(cluster, tmp_path, "refill", *common, "algorithm.refill_rounds=5")
    assert all(r["reward/groups_kept"] < 8 for r in plain)
    assert all(r["reward/groups_kept"] == r["actor/samples"] / 4 for r in plain)
    for r in full:
        assert (r["reward/groups_kept"], r["actor/samples"]) == (8, 32), r
        assert r["reward/groups_drawn"] == 8 * r["rollout/rounds"]
        assert r["reward/groups_drawn"] == r["reward/groups_kept"] + r["reward/groups_dropped"] + \
            r["reward/groups_surplus"]
    assert all(r["rollout/rounds"] > 1 for r in full)
    assert sum(r["reward/groups_surplus"] for r in full) > 0
    assert full[0]["rollout/tokens"] > plain[0]["rollout/tokens"]  # the refill rounds' tokens are counted


def test_refill_stops_after_its_rounds_when_no_group_has_signal(cluster, tmp_path):
    """The untrained model answers no sum right: every round's groups are dropped, the refill gives up after
    1 + refill_rounds rounds, and the step trains on nothing (the run goes on)."""
    rows = run(cluster, tmp_path, "none", "algorithm.dynamic_sampling=true", "reward.fn=exact_match",
               "algorithm.refill_rounds=2", "run.steps=1")
    assert (rows[0]["rollout/rounds"], rows[0]["reward/groups_drawn"], rows[0]["reward/groups_dropped"],
            rows[0]["reward/groups_kept"], rows[0]["actor/samples"]) == (3, 24, 24, 0, 0)


def test_refill_rounds_are_checked():
    with pytest.raises(C.ConfigError, match="set algorithm.dynamic_sampling=true"):
        C.load(ReasoningConfig, None, ["algorithm.refill_rounds=2"])
    with pytest.raises(C.ConfigError, match="needs on-policy rollouts"):
        C.load(ReasoningConfig, None, ["algorithm.refill_rounds=2", "algorithm.dynamic_sampling=true",
                                         "algorithm.max_staleness=1"])
    with pytest.raises(C.ConfigError, match="algorithm.refill_rounds must be >= 0, got -1"):
        C.load(ReasoningConfig, None, ["algorithm.refill_rounds=-1", "algorithm.dynamic_sampling=true"])
