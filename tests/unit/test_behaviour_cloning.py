"""Behaviour cloning's data and fit (m2flow/embodied/bc.py), on hand-made demonstrations."""

import numpy as np
import pytest
import torch
from gymnasium import spaces

from m2flow.embodied.bc import bc_dataset, fit
from m2flow.embodied.policies import MLPActorCritic

SUMMARY = {"task": "Toy-v0", "episodes": [{"success": True}, {"success": False}, {"success": True}]}
ARRAYS = {"obs": np.arange(7, dtype=np.float32)[:, None] * [1.0, -1.0],
          "actions": np.arange(7, dtype=np.float32)[:, None] / 10,
          "rewards": np.array([1, 0, 2, 5, 5, 0, 1], np.float32),
          "episode": np.array([0, 0, 0, 1, 1, 2, 2], np.int32)}


def test_the_dataset_keeps_successful_episodes_chunks_actions_and_discounts_returns():
    data = bc_dataset(ARRAYS, SUMMARY, chunk=2, gamma=0.5)
    assert int(data["episodes"]) == 2 and data["obs"][:, 0].tolist() == [0, 1, 2, 5, 6]  # episode 1 failed
    # row t: actions t and t + 1 of its own episode, the last one repeated past the end
    assert data["actions"][:, :, 0].flatten().tolist() == pytest.approx([0, .1, .1, .2, .2, .2, .5, .6, .6, .6])
    # returns: 1 + 0.5 * (0 + 0.5 * 2) = 1.5, 0 + 0.5 * 2 = 1, 2; then 0 + 0.5 * 1 = 0.5, 1
    assert data["returns"].tolist() == pytest.approx([1.5, 1.0, 2.0, 0.5, 1.0])
    assert int(bc_dataset(ARRAYS, SUMMARY, successful_only=False)["episodes"]) == 3
    assert int(bc_dataset(ARRAYS, SUMMARY, episodes=1)["episodes"]) == 1
    with pytest.raises(ValueError, match="no successful demonstrations among the first 2 episodes"):
        bc_dataset(ARRAYS, {"task": "Toy-v0", "episodes": [{"success": False}] * 2})


def test_fitting_raises_the_likelihood_of_the_demonstrated_actions_and_fits_the_returns():
    torch.manual_seed(0)
    policy = MLPActorCritic(2, spaces.Box(-1, 1, (1,)), hidden=(32,), log_std_init=0.0)
    data = bc_dataset(ARRAYS, SUMMARY, gamma=0.5)
    first = fit(policy, data, steps=1, lr=0.0)  # lr 0: the untrained policy's figures
    last = fit(policy, data, steps=400, lr=1e-2)
    assert last["bc/nll"] < first["bc/nll"] - 1.0 and last["bc/vf_loss"] < 0.25 * first["bc/vf_loss"]
    with torch.no_grad():
        mean = policy.act(data["obs"], deterministic=True)[0][:, 0]
    assert mean.tolist() == pytest.approx(data["actions"][:, 0].tolist(), abs=0.05)


def test_rl_from_a_cloned_policy_starts_at_its_std_times_init_std_scale(tmp_path):
    """`policy.init` loads the cloned policy into the actor; `policy.init_std_scale` narrows its exploration (the
    std BC fitted to the demonstrations' residuals), leaving the mean and the critic as cloned."""
    from safetensors.torch import save_file

    from m2flow import config as C
    from m2flow.embodied.config import EmbodiedConfig
    from m2flow.embodied.workers.actor import EmbodiedActorWorker
    from m2flow.embodied.workers.policy import make_policy

    cfg = C.load(EmbodiedConfig, "ppo_pickcube", [])
    obs_space, action_space = spaces.Box(-np.inf, np.inf, (42,)), spaces.Box(-1, 1, (4,))
    cloned = make_policy(cfg, obs_space, action_space)
    with torch.no_grad():
        cloned.log_std.fill_(-1.0)
    save_file(cloned.state_dict(), str(tmp_path / "policy.safetensors"))

    def actor(*overrides):
        return EmbodiedActorWorker(C.load(EmbodiedConfig, "ppo_pickcube", [f"policy.init={tmp_path}", *overrides]),
                                   obs_space, action_space).policy

    assert actor().log_std.tolist() == pytest.approx([-1.0] * 4)
    narrowed = actor("policy.init_std_scale=0.25")
    assert narrowed.log_std.exp().tolist() == pytest.approx([0.25 * np.exp(-1.0)] * 4)
    same = {k: v for k, v in cloned.state_dict().items() if k != "log_std"}
    assert all(torch.equal(narrowed.state_dict()[k], v) for k, v in same.items())
    with pytest.raises(C.ConfigError, match="policy.init_std_scale must be > 0, got 0.0"):
        C.load(EmbodiedConfig, "ppo_pickcube", ["policy.init_std_scale=0"])


def test_sacs_squashed_actor_clones_a_bang_bang_dimension_at_every_state():
    """SAC's actor (`m2flow sft` on an algorithm.name=sac config): a dimension demonstrated at its bounds only (a
    gripper's +-1), its sign set by the state, is fitted at the rare states too (a plain likelihood, whose mean's
    gradient shrinks with the state's own std, got all 48 "closed" rows wrong here; this fit none), with the log std
    well inside the clamp; log pi's value is the squashed Gaussian's of the pulled-in action."""
    from m2flow.algorithms.sac import squashed_gaussian_logprob
    from m2flow.embodied.policies import SquashedGaussianActor

    gen = torch.Generator().manual_seed(0)
    obs = torch.rand(600, 3, generator=gen) * 2 - 1
    obs = obs[(obs[:, 0] - 0.8).abs() > 0.03][:512]  # a margin at the boundary, which an MLP cannot draw sharp
    grip = torch.where(obs[:, 0] > 0.8, 1.0, -1.0)  # "closed" on one tenth of the states only
    data = {"obs": obs, "actions": torch.stack([0.5 * obs[:, 1], grip], 1), "returns": torch.zeros(512)}
    torch.manual_seed(0)
    actor = SquashedGaussianActor(3, spaces.Box(-1, 1, (2,)), hidden=(64, 64))
    fit(actor, data, steps=600, lr=3e-3, vf_coef=0.0)
    with torch.no_grad():
        mean, log_std = actor.dist(obs)
        logprob = actor.evaluate(obs, data["actions"])[0]
    assert (torch.tanh(mean[:, 1]).sign() != grip).sum() <= 2  # of 512 rows, 48 of them "closed"
    assert (torch.tanh(mean[:, 0]) - data["actions"][:, 0]).abs().max() < 0.1
    assert log_std.min() > SquashedGaussianActor.LOG_STD_MIN + 10  # inside the clamp, where SAC can widen it
    u = torch.atanh(data["actions"].clamp(-SquashedGaussianActor.BC_BOUND, SquashedGaussianActor.BC_BOUND))
    floored = log_std.clamp(min=np.log(SquashedGaussianActor.BC_STD_MIN))
    assert logprob.tolist() == pytest.approx(squashed_gaussian_logprob(u, mean, floored).tolist(), rel=1e-5)


def test_sac_from_a_cloned_actor_starts_at_its_std_times_init_std_scale(tmp_path):
    """`policy.init` loads a cloned SAC actor into the learner and `policy.init_std_scale` scales its state-dependent
    std everywhere (the log std head's bias), leaving its mean as cloned."""
    from safetensors.torch import save_file

    from m2flow import config as C
    from m2flow.embodied.config import EmbodiedConfig
    from m2flow.embodied.sac.learner import SACLearnerWorker
    from m2flow.embodied.workers.policy import make_policy

    obs_space, action_space = spaces.Box(-np.inf, np.inf, (42,)), spaces.Box(-1, 1, (4,))
    cloned = make_policy(C.load(EmbodiedConfig, "rlpd_pickcube", []), obs_space, action_space)
    save_file(cloned.state_dict(), str(tmp_path / "policy.safetensors"))
    cfg = C.load(EmbodiedConfig, "rlpd_pickcube", [f"policy.init={tmp_path}", "policy.init_std_scale=0.5",
                                                      "sac.demos=''", "sac.bc_coef=0"])
    learner = SACLearnerWorker(cfg, obs_space, action_space)
    obs = torch.randn(16, 42)
    with torch.no_grad():
        (mean, log_std), (mean0, log_std0) = learner.policy.dist(obs), cloned.dist(obs)
    assert torch.equal(mean, mean0)
    assert (log_std - log_std0).flatten().tolist() == pytest.approx([np.log(0.5)] * 64, abs=1e-6)


def test_a_behaviour_cloning_term_beside_the_rl_loss_pulls_the_policy_to_the_demonstrations():
    """`actor.bc_coef` (DAPG): every minibatch's loss adds bc_coef x the NLL of demonstrated actions. On a rollout
    with no reward (no advantage: the RL loss moves nothing) the policy's NLL of the demonstrations falls with the
    term and stays without it; the coefficient decays by actor.bc_decay each iteration."""
    from pathlib import Path

    from m2flow import config as C
    from m2flow.embodied.bc import demo_data
    from m2flow.embodied.config import EmbodiedConfig
    from m2flow.embodied.envs import Trajectory
    from m2flow.embodied.workers.actor import EmbodiedActorWorker

    demos = Path(__file__).resolve().parents[1] / "fixtures" / "demos" / "PickCube-v1"
    obs_space, action_space = spaces.Box(-np.inf, np.inf, (42,)), spaces.Box(-1, 1, (4,))
    data = demo_data(str(demos), "PickCube-v1")
    T, N = 16, 4
    gen = torch.Generator().manual_seed(0)
    traj = Trajectory(obs=torch.randn(T, N, 42, generator=gen), actions=torch.randn(T, N, 4, generator=gen),
                      logprobs=torch.zeros(T, N), values=torch.zeros(T, N), rewards=torch.zeros(T, N),
                      terminated=torch.zeros(T, N, dtype=torch.bool), truncated=torch.zeros(T, N, dtype=torch.bool),
                      final_values=torch.zeros(T, N), next_obs=torch.randn(N, 42, generator=gen),
                      next_values=torch.zeros(N))

    class Box:
        def get(self, key=None):
            return {"env_rank": 0, "traj": traj, "scores": None}

    def demo_nll(actor) -> float:
        with torch.no_grad():
            return float(-actor.policy.evaluate(data["obs"], data["actions"])[0].mean())

    def trained(*overrides):
        actor = EmbodiedActorWorker(C.load(EmbodiedConfig, "ppo_pickcube", ["actor.minibatch_size=16",
                                                                              *overrides]), obs_space, action_space)
        before = demo_nll(actor)
        rows = [actor.train(Box(), step, 1) for step in range(2)]
        return before, demo_nll(actor), rows

    before, after, rows = trained("actor.bc_coef=0.5", "actor.bc_decay=0.5", f"actor.bc_demos={demos}")
    assert after < before - 0.5, (before, after)
    assert [r["actor/bc_coef"] for r in rows] == [0.5, 0.25] and all(r["actor/bc_nll"] > 0 for r in rows)
    plain_before, plain_after, plain = trained()
    assert plain_after == pytest.approx(plain_before, abs=1e-3) and "actor/bc_nll" not in plain[0]


def test_random_shifts_move_each_cameras_frame_and_leave_the_other_fields():
    from m2flow.embodied.bc import shift_frames
    from m2flow.embodied.envs.packed import Field, PackedLayout

    layout = PackedLayout([Field("state", "float32", (3,)), Field("rgb", "uint8", (6, 5, 5))])  # two cameras
    rgb = (np.arange(2 * 6 * 25) % 251).astype(np.uint8).reshape(2, 6, 5, 5)
    rows = torch.as_tensor(np.stack([layout.pack(state=np.array([1.5, -2, 3], np.float32), rgb=f) for f in rgb]))
    assert shift_frames(rows, layout, 0, torch.Generator()) is rows
    gen = torch.Generator().manual_seed(3)
    out = shift_frames(rows, layout, 2, gen)
    assert torch.equal(rows, torch.as_tensor(np.stack([layout.pack(state=np.array([1.5, -2, 3], np.float32), rgb=f)
                                                       for f in rgb])))  # the input untouched
    got = layout.unpack(out)
    assert got["state"].tolist() == [[1.5, -2, 3]] * 2
    # redraw the offsets the call drew: frame k (row k // 2, camera k % 2) starts at (dy - 2, dx - 2) of the original
    again = torch.Generator().manual_seed(3)
    dy, dx = (torch.randint(0, 5, (4,), generator=again) for _ in range(2))
    assert len({(int(a), int(b)) for a, b in zip(dy, dx)}) > 1  # the frames moved differently
    for k in range(4):
        frame = rgb[k // 2, 3 * (k % 2):3 * (k % 2) + 3]
        ys = np.clip(np.arange(5) + int(dy[k]) - 2, 0, 4)  # the border repeated past the edge
        xs = np.clip(np.arange(5) + int(dx[k]) - 2, 0, 4)
        want = frame[:, ys][:, :, xs]
        assert np.array_equal(got["rgb"][k // 2, 3 * (k % 2):3 * (k % 2) + 3].numpy(), want), k
