"""Embodied env layer: factory errors, action checks, non-finite data, episode bookkeeping, chunks, normalization,
seed groups and pipeline stages (staged stepping must equal whole-group stepping bit for bit)."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from m2flow.embodied.envs import EnvGroup, ObsNormalizer, RewardScaler, RunningMeanStd, Trajectory, collect_lockstep, make_env_fns, make_vector_env, summarize_episodes
from m2flow.embodied.policies import build_policy

TOY = "m2flow-test/Toy-v0"  # time limit 5


class ToyEnv(gym.Env):
    """obs [t, x]: t the episode step, x += action each step (x0 ~ U(-1, 1) from the reset seed); reward 1 + a + t/10.

    term_at: terminate when t reaches it; nan_at / nan_field: emit NaN there; report_success: info["success"] = x > 1.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, term_at=None, nan_at=None, nan_field="observation", report_success=False, render_mode=None):
        self.observation_space = spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.term_at, self.nan_at, self.nan_field = term_at, nan_at, nan_field
        self.report_success, self.render_mode = report_success, render_mode

    def _obs(self):
        return np.array([self.t, self.x], np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.x = 0, float(self.np_random.uniform(-1, 1))
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        self.x += float(action[0])
        obs, reward = self._obs(), 1.0 + float(action[0]) + self.t / 10
        if self.t == self.nan_at:
            obs, reward = (obs * np.nan, reward) if self.nan_field == "observation" else (obs, float("nan"))
        info = {"success": self.x > 1.0} if self.report_success else {}
        return obs, reward, self.t == self.term_at, False, info

    def render(self):
        frame = np.zeros((32, 48, 3), np.uint8)
        frame[:, : 8 * (self.t % 6)] = 200
        return frame


if TOY not in gym.registry:
    gym.register(id=TOY, entry_point=ToyEnv, max_episode_steps=5)


def toy_group(n=2, kwargs_per_env=None, **options):
    kws = kwargs_per_env or [{}] * n
    return EnvGroup([lambda kw=kw: gym.make(TOY, **kw) for kw in kws], seed=0, **options)


# --- factory ---


def test_unknown_env_id_lists_close_matches():
    with pytest.raises(ValueError, match=r"unknown gymnasium env id 'CartPol-v1'.*CartPole-v1"):
        make_env_fns("CartPol-v1", 2)
    with pytest.raises(ValueError, match="HalfCheetah-v5"):
        EnvGroup.make("HalfCheeta-v5", 2)


def test_factory_makes_the_listed_envs():
    for env_id, obs_dim in (("CartPole-v1", 4), ("HalfCheetah-v5", 17), ("Hopper-v5", 11)):
        g = EnvGroup.make(env_id, 2, seed=0)
        assert g.reset().shape == (2, obs_dim) and g.env_id == env_id
        g.close()


def test_mujoco_warnings_do_not_litter_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    EnvGroup.make("HalfCheetah-v5", 2).close()  # its XML triggers a MuJoCo deprecation warning per env
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()


def test_envgroup_matches_sync_vector_env_same_step():
    """EnvGroup steps its envs itself, with exactly SyncVectorEnv's SAME_STEP autoreset contract."""
    for env_id, kw in (("CartPole-v1", {}), ("HalfCheetah-v5", {"max_episode_steps": 7})):
        vec = make_vector_env(env_id, 3, seed=5, **kw)
        group = EnvGroup.make(env_id, 3, seed=5, env_kwargs=kw)
        obs_v, _ = vec.reset(seed=5)
        np.testing.assert_array_equal(group.reset(), obs_v.astype(np.float32))
        rng = np.random.default_rng(0)
        for _ in range(40):
            a = rng.integers(0, 2, 3) if env_id == "CartPole-v1" else rng.uniform(-1, 1, (3, 6)).astype(np.float32)
            obs_v, rew_v, term_v, trunc_v, info = vec.step(a)
            res = group.step(a)
            np.testing.assert_array_equal(res.obs, obs_v.astype(np.float32))
            np.testing.assert_array_equal(res.raw_reward, rew_v)
            np.testing.assert_array_equal(res.terminated, term_v)
            np.testing.assert_array_equal(res.truncated, trunc_v & ~term_v)
            for i in np.flatnonzero(info.get("_final_obs", np.zeros(3, bool))):
                np.testing.assert_array_equal(res.final_obs[i], info["final_obs"][i].astype(np.float32))
        vec.close()
        group.close()


def test_pixel_observations_are_channel_first_uint8():
    g = EnvGroup(make_env_fns(TOY, 2, pixels=True, image_size=64))
    obs = g.reset()
    assert obs.shape == (2, 3, 64, 64) and obs.dtype == np.uint8
    res = g.step(np.zeros((2, 1), np.float32))
    row = res.obs[0, 0, 0]  # after 1 step the frame's left 8 of 48 columns are lit: 64 * 8 / 48 = 10.7 of 64
    assert res.obs.dtype == np.uint8 and row[:10].min() == 200 and 0 < row[10] < 200 and row[11:].max() == 0
    policy = build_policy(g.observation_space, g.action_space, kind="cnn", features_dim=32)
    traj = collect_lockstep(g, policy.act, 3, policy.value)
    assert traj.obs.shape == (3, 2, 3, 64, 64) and traj.obs.dtype == torch.uint8 and traj.actions.shape == (3, 2, 1)
    with pytest.raises(ValueError, match="norm_obs needs float observations"):
        EnvGroup(make_env_fns(TOY, 2, pixels=True), norm_obs=True)


# --- checks ---


def test_action_space_mismatch_names_env_and_space():
    g = EnvGroup.make("CartPole-v1", 2)
    g.reset()
    with pytest.raises(ValueError, match=r"CartPole-v1.*Discrete\(2\).*expected shape \(2,\)"):
        g.step(np.zeros((2, 1), np.int64))
    with pytest.raises(TypeError, match=r"CartPole-v1.*expected integer actions"):
        g.step(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"CartPole-v1.*outside \[0, 2\)"):
        g.step(np.array([0, 2]))
    t = toy_group(2, clip_actions=False)
    t.reset()
    with pytest.raises(ValueError, match=rf"{TOY}.*Box\(-1.0, 1.0, \(1,\), float32\).*expected shape \(2, 1\)"):
        t.step(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=rf"{TOY}.*outside the bounds"):
        t.step(np.array([[0.5], [1.5]], np.float32))
    with pytest.raises(ValueError, match=r"non-finite actions for envs \[1\]"):
        t.step(np.array([[0.5], [np.nan]], np.float32))
    with pytest.raises(ValueError, match=r"expected shape \(n=2, k, \*\(1,\)\)"):
        t.step_chunk(np.zeros((2, 1), np.float32))


def test_box_actions_are_clipped_at_the_env_step():
    g = toy_group(1)
    x0 = g.reset()[0, 1]
    res = g.step(torch.tensor([[5.0]]))  # torch actions accepted; clipped to 1.0
    assert res.raw_reward[0] == pytest.approx(1.0 + 1.0 + 0.1) and res.obs[0, 1] == pytest.approx(x0 + 1.0)


@pytest.mark.parametrize("field", ["observation", "reward"])
def test_non_finite_data_names_env_index_and_step(field):
    g = toy_group(2, [{}, {"nan_at": 3, "nan_field": field}])
    g.reset()
    g.step(np.zeros((2, 1), np.float32))
    g.step(np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match=rf"{TOY}: non-finite {field} from env 1 at step \(env step 3, episode step 3\)"):
        g.step(np.zeros((2, 1), np.float32))


# --- episodes ---


def test_terminated_vs_truncated_and_final_obs():
    # env 0 terminates at t=3, env 1 runs into the 5-step time limit, env 2 terminates at the limit (terminated wins)
    g = toy_group(3, [{"term_at": 3}, {}, {"term_at": 5}])
    x = g.reset()[:, 1].copy()
    zero = np.zeros((3, 1), np.float32)
    results = [g.step(zero) for _ in range(5)]
    term = np.stack([r.terminated for r in results])
    trunc = np.stack([r.truncated for r in results])
    assert term[:, 0].tolist() == [False, False, True, False, False]
    assert not trunc[:, 0].any()
    assert trunc[:, 1].tolist() == [False, False, False, False, True] and not term[:, 1].any()
    assert term[:, 2].tolist() == [False] * 4 + [True] and not trunc[:, 2].any()
    np.testing.assert_array_equal(results[2].final_obs[0], [3, x[0]])
    np.testing.assert_array_equal(results[4].final_obs[1], [5, x[1]])  # the truncated episode's last obs is kept
    assert results[4].obs[1, 0] == 0 and results[2].obs[0, 0] == 0  # SAME_STEP: obs is the next episode's first
    assert not results[3].final_obs[1].any()  # zero where no episode ended
    assert [e["length"] for e in g.pop_episodes()] == [3, 5, 5]


def test_episode_returns_equal_sum_of_raw_rewards_with_reward_scaling():
    g = EnvGroup.make("CartPole-v1", 4, seed=3, norm_reward=True, norm_obs=True)
    g.reset()
    rng = np.random.default_rng(1)
    running, expected = np.zeros(4), []
    for _ in range(300):
        res = g.step(rng.integers(0, 2, 4))
        running += res.raw_reward
        for i in np.flatnonzero(res.terminated | res.truncated):
            expected.append((i, running[i]))
            running[i] = 0
    assert not np.allclose(res.reward, res.raw_reward)  # rewards are scaled, returns are not
    episodes = g.pop_episodes()
    assert len(episodes) == len(expected) > 10
    for ep, (i, ret) in zip(sorted(episodes, key=lambda e: e["env_index"]), sorted(expected, key=lambda e: e[0])):
        assert ep["env_index"] == i and ep["return"] == pytest.approx(ret) and ep["length"] == ret  # reward 1 / step
    assert "success_once" not in episodes[0] and g.pop_episodes() == []


def test_success_once_per_episode():
    g = toy_group(2, [{"report_success": True}] * 2)
    g.reset()
    for _ in range(5):  # env 0 pushes x up (> 1 at some step), env 1 pushes it down
        g.step(np.array([[1.0], [-1.0]], np.float32))
    eps = {e["env_index"]: e for e in g.pop_episodes()}
    assert eps[0]["success_once"] is True and eps[1]["success_once"] is False
    assert eps[0]["success"] is True and eps[1]["success"] is False  # at the episode's last step
    assert summarize_episodes(list(eps.values()))["success_once"] == 0.5


def test_action_chunks_stop_at_episode_end():
    g = toy_group(2, [{"term_at": 4}, {}])
    x = g.reset()[:, 1].copy()
    a = np.full((2, 3, 1), 0.5, np.float32)
    r1 = g.step_chunk(a)
    assert r1.env_steps.tolist() == [3, 3] and r1.obs[:, 0].tolist() == [3, 3]
    assert r1.raw_reward[0] == pytest.approx(sum(1.5 + t / 10 for t in (1, 2, 3)))
    r2 = g.step_chunk(a)  # env 0 terminates at its 1st sub-step (t=4), env 1 is truncated at its 2nd (t=5)
    assert r2.env_steps.tolist() == [1, 2]
    assert r2.terminated.tolist() == [True, False] and r2.truncated.tolist() == [False, True]
    assert r2.raw_reward[0] == pytest.approx(1.5 + 0.4) and r2.raw_reward[1] == pytest.approx(1.5 + 0.4 + 1.5 + 0.5)
    np.testing.assert_allclose(r2.final_obs, [[4, x[0] + 2.0], [5, x[1] + 2.5]], rtol=1e-6)
    assert r2.obs[:, 0].tolist() == [0, 0]
    eps = sorted(g.pop_episodes(), key=lambda e: e["env_index"])
    assert [e["length"] for e in eps] == [4, 5]
    assert eps[0]["return"] == pytest.approx(r1.raw_reward[0] + r2.raw_reward[0])


def test_collect_lockstep_bootstraps_truncated_steps_from_final_obs():
    g = toy_group(2, [{"term_at": 3}, {}])

    def policy(obs):
        return torch.zeros(len(obs), 1), torch.zeros(len(obs)), obs[:, 0] * 10

    traj = collect_lockstep(g, policy, 7, value_fn=lambda obs: obs[:, 0] * 10)
    assert traj.obs.shape == (7, 2, 2) and traj.actions.shape == (7, 2, 1) and traj.rewards.shape == (7, 2)
    assert traj.terminated[:, 0].tolist() == [False, False, True, False, False, True, False]
    assert traj.truncated[:, 1].tolist() == [False] * 4 + [True, False, False]
    expected = torch.zeros(7, 2)
    expected[4, 1] = 50.0  # V(final obs [5, x]) at the truncated step, 0 elsewhere (terminated: no bootstrap)
    torch.testing.assert_close(traj.final_values, expected)
    torch.testing.assert_close(traj.next_values, traj.next_obs[:, 0] * 10)
    both = Trajectory.cat_envs([traj, traj])
    assert both.obs.shape == (7, 4, 2) and both.next_obs.shape == (4, 2)


# --- seeds + stages ---


def test_seed_groups_share_initial_observations():
    g = EnvGroup.make("HalfCheetah-v5", 4, seed=3, seed_groups=2)
    obs = g.reset()
    np.testing.assert_array_equal(obs[0], obs[1])
    np.testing.assert_array_equal(obs[2], obs[3])
    assert not np.array_equal(obs[0], obs[2])
    again = g.reset(seed=11)
    np.testing.assert_array_equal(again[2], again[3])
    assert not np.array_equal(again[0], obs[0])
    with pytest.raises(ValueError, match="seed_groups=3 must divide num_envs=4"):
        EnvGroup.make("CartPole-v1", 4, seed_groups=3)
    ungrouped = EnvGroup.make("HalfCheetah-v5", 2, seed=3).reset()  # env i gets seed + i
    np.testing.assert_array_equal(ungrouped[0], obs[0])
    assert not np.array_equal(ungrouped[1], obs[1])


def _rollout(groups, steps, k):
    """Step `groups` (the whole group, or its stages) one after another, step by step, with a deterministic policy
    that is row-wise exact (no batch-size dependent matmul), as a pipelined env worker does. -> per-field arrays."""
    obs = [g.reset() for g in groups]
    out = {"obs": [], "reward": [], "terminated": [], "truncated": [], "final_obs": []}
    for _ in range(steps):
        step = []
        for s, g in enumerate(groups):
            a = np.tanh(obs[s][:, :6] * 0.7)
            res = g.step(a) if k == 1 else g.step_chunk(np.stack([a * (1 - 0.3 * j) for j in range(k)], 1))
            obs[s] = res.obs
            step.append(res)
        for key in out:
            out[key].append(np.concatenate([getattr(r, key) for r in step]))
    return {key: np.stack(v) for key, v in out.items()}


@pytest.mark.parametrize("k", [1, 3])
def test_staged_stepping_equals_whole_group_bit_for_bit(k):
    make = lambda: EnvGroup.make("HalfCheetah-v5", 4, seed=7, norm_obs=True, norm_reward=True,
                                 env_kwargs={"max_episode_steps": 10})
    whole = make()
    reference = _rollout([whole], 25, k)
    assert reference["truncated"].any()  # episodes end inside the rollout
    for stages in (2, 3):
        group = make()
        got = _rollout(group.split(stages), 25, k)
        for key in reference:
            assert np.array_equal(got[key], reference[key]), f"{key} differs with {stages} stages"
        for key, value in whole.state_dict().items():
            assert torch.equal(group.state_dict()[key], value), key


def test_split_views_cover_consecutive_envs():
    g = EnvGroup.make("CartPole-v1", 5)
    views = g.split(3)
    assert [list(v.env_indices) for v in views] == [[0], [1, 2], [3, 4]]
    assert views[1].envs == g.envs[1:3]
    with pytest.raises(ValueError, match="cannot split 5 envs into 6 stages"):
        g.split(6)


# --- normalize ---


def test_running_mean_std_parallel_update_matches_numpy():
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, (1000, 5))
    rms = RunningMeanStd((5,), epsilon=1e-12)
    for chunk in np.array_split(data, [1, 7, 300, 301]):
        rms.update(chunk)
    np.testing.assert_allclose(rms.mean, data.mean(0), rtol=1e-9)
    np.testing.assert_allclose(rms.var, data.var(0), rtol=1e-6)
    with pytest.raises(ValueError, match=r"expected batches \[B, \*\(5,\)\]"):
        rms.update(np.zeros((3, 4)))


def test_reward_scaler_divides_by_std_of_discounted_returns():
    scaler = RewardScaler(gamma=0.9, clip=100.0)
    returns, seen = np.zeros(2), []
    for r in ([1.0, 2.0], [1.0, 2.0], [1.0, 2.0]):
        returns = returns * 0.9 + np.array(r)
        scaler.update(returns)
        seen.append(returns.copy())
    seen = np.concatenate(seen)
    assert scaler.rms.var == pytest.approx(seen.var(), rel=1e-3)
    np.testing.assert_allclose(scaler(np.array([1.0, -2.0])), np.array([1.0, -2.0]) / np.sqrt(seen.var()), rtol=1e-3)


def test_normalizer_state_round_trips(tmp_path):
    from safetensors.torch import load_file, save_file

    norm = ObsNormalizer((3,), clip=5.0)
    norm.update(np.random.default_rng(0).normal(2, 3, (50, 3)))
    fresh = ObsNormalizer((3,), clip=5.0)
    fresh.load_state_dict(norm.state_dict())
    x = np.random.default_rng(1).normal(0, 5, (4, 3))
    np.testing.assert_array_equal(fresh(x), norm(x))

    g = EnvGroup.make("HalfCheetah-v5", 2, seed=0, norm_obs=True, norm_reward=True)
    collect_lockstep(g, lambda o: (torch.zeros(2, 6), torch.zeros(2), None), 20)
    state = g.state_dict()
    assert set(state) == {f"{p}.{k}" for p in ("obs", "reward") for k in ("mean", "var", "count")}
    save_file(state, tmp_path / "norm.safetensors")
    torch.save(state, tmp_path / "norm.pt")
    for loaded in (load_file(tmp_path / "norm.safetensors"), torch.load(tmp_path / "norm.pt")):
        other = EnvGroup.make("HalfCheetah-v5", 2, seed=0, norm_obs=True, norm_reward=True, training=False)
        other.load_state_dict(loaded)
        for key, value in state.items():
            assert torch.equal(other.state_dict()[key], value)
        raw = np.stack([env.reset(seed=i)[0] for i, env in enumerate(g.envs)])  # what other.reset() sees
        expected = ObsNormalizer((17,))
        expected.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("obs.")})
        np.testing.assert_array_equal(other.reset(), expected(raw))
        other.step(np.zeros((2, 6), np.float32))
        assert torch.equal(other.state_dict()["obs.mean"], state["obs.mean"])  # training=False: frozen
    with pytest.raises(KeyError, match="expected"):
        other.load_state_dict({"obs.mean": state["obs.mean"]})


def test_a_snapshot_continues_episodes_where_they_were_and_views_see_the_restore():
    group = EnvGroup.make("Pendulum-v1", 4, seed=5)
    stages = group.split(2)
    group.reset()
    rng = np.random.default_rng(0)
    acts = [rng.uniform(-2, 2, (4, 1)).astype(np.float32) for _ in range(8)]
    for a in acts[:3]:
        group.step(a)
    blob = group.snapshot()
    assert blob is not None
    ahead = [group.step(a) for a in acts[3:]]
    group.restore(blob)  # back to step 3: the same actions give the same steps, in the stage views too
    again = [np.concatenate([st.step(a[st.env_indices]).obs for st in stages]) for a in acts[3:]]
    assert all(np.array_equal(x.obs, y) for x, y in zip(ahead, again))
    other = EnvGroup.make("Pendulum-v1", 2, seed=5)
    with pytest.raises(ValueError, match="holds 4 envs of Pendulum-v1, this group 2"):
        other.restore(blob)


def test_a_snapshot_written_before_the_embodied_wing_moved_still_restores():
    """Snapshots written when these modules lived in m2flow.workloads.embodied name their classes there: a resume
    from such a checkpoint maps the old names to the new (a plain unpickler cannot import them)."""
    import pickle

    group = EnvGroup.make("Pendulum-v1", 2, seed=5, norm_obs=True)
    group.reset()
    rng = np.random.default_rng(0)
    acts = [rng.uniform(-2, 2, (2, 1)).astype(np.float32) for _ in range(6)]
    for a in acts[:3]:
        group.step(a)
    old = pickle.dumps(pickle.loads(group.snapshot()), protocol=0)  # protocol 0 names each class's module as text
    for new, before in (("m2flow.embodied.envs.group", "m2flow.workloads.embodied.envs"),
                        ("m2flow.embodied.envs.normalize", "m2flow.workloads.embodied.normalize")):
        assert new.encode() in old
        old = old.replace(new.encode(), before.encode())
    with pytest.raises(ModuleNotFoundError, match="m2flow.workloads"):
        pickle.loads(old)
    ahead = [group.step(a).obs for a in acts[3:]]
    group.restore(old)
    assert all(np.array_equal(x, group.step(a).obs) for x, a in zip(ahead, acts[3:]))


def test_a_mujoco_snapshot_carries_the_simulator_state_that_pickling_loses():
    """gymnasium's MuJoCo envs pickle by rebuilding themselves (EzPickle): the snapshot adds MuJoCo's integration
    state and the env's RNG, so the restored envs step as the originals, resets included."""
    group = EnvGroup.make("HalfCheetah-v5", 2, seed=3, env_kwargs={"max_episode_steps": 5})
    group.reset()
    rng = np.random.default_rng(0)
    acts = [rng.uniform(-1, 1, (2, 6)).astype(np.float32) for _ in range(8)]  # past a time limit: a reset too
    for a in acts[:3]:
        group.step(a)
    blob = group.snapshot()
    ahead = [group.step(a) for a in acts[3:]]
    group.restore(blob)
    again = [group.step(a) for a in acts[3:]]
    assert any(r.truncated.any() for r in ahead)
    for x, y in zip(ahead, again):
        assert np.array_equal(x.obs, y.obs) and np.array_equal(x.reward, y.reward)
