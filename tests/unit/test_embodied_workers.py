"""Embodied workers as local objects (no Ray): stages change timing not data, the env worker equals the lockstep
reference, GAE on real rollouts with truncations equals a naive loop, per-env sampling noise, GRPO advantages,
checkpoint round trip (weights, optimizer, obs normalizer) and evaluation, bad inputs with clear errors."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from torch.distributions import Categorical, Normal

from m2flow import config as C
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.envs import Trajectory, collect_lockstep
from m2flow.embodied.evaluation import evaluate_checkpoint
from m2flow.embodied.workers.actor import EmbodiedActorWorker, advantages, load_policy
from m2flow.embodied.workers.env import EnvWorker, make_env_group
from m2flow.embodied.workers.policy import PolicyWorker, make_policy, sample_actions

NAN_ENV = "m2flow-test/NaNAtStep7-v0"


class NaNAtStep7(gym.Env):
    """CartPole-like obs [4]; env 1 (an even reset seed, with run.seed=3) emits NaN in its obs at episode step 7."""

    observation_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, render_mode=None):
        self.render_mode = render_mode

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.bad = 0, bool(seed is not None and seed % 2 == 0)
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.full(4, np.nan if self.bad and self.t == 7 else 0.0, np.float32)
        return obs, 1.0, False, False, {}


class Blink(NaNAtStep7):
    """Never NaN; renders a frame that changes with the step (for video recording)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def reset(self, seed=None, options=None):
        obs, info = super().reset(seed=seed)
        self.bad = False
        return obs, info

    def render(self):
        return np.full((24, 32, 3), 20 * self.t, np.uint8)


class Reach(gym.Env):
    """Sparse success: x starts at 0, action 1 moves it +1, action 0 moves it -1; success (and the end) at x = 3."""

    observation_space = spaces.Box(-20, 20, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, render_mode=None):
        self.render_mode = render_mode

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.x = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.x += 1 if int(action) == 1 else -1
        success = self.x >= 3
        return np.array([self.x], np.float32), float(success), success, False, {"success": success}


BLINK_ENV, REACH_ENV = "m2flow-test/Blink-v0", "m2flow-test/Reach-v0"
for env_id, cls in ((NAN_ENV, NaNAtStep7), (BLINK_ENV, Blink), (REACH_ENV, Reach)):
    if env_id not in gym.registry:
        gym.register(id=env_id, entry_point=cls, max_episode_steps=50)


def make_cfg(**over):
    base = {"run": {"seed": 3}, "env": {"id": "CartPole-v1", "num_envs": 6, "max_episode_steps": 14,
                                        "norm_obs": True, "norm_reward": True},
            "rollout": {"steps": 24}, "actor": {"epochs": 2, "minibatch_size": 48}}
    return C.load(EmbodiedConfig, C.merge(base, over))


class Now:
    """The handle interface (`.wait() -> [result]`) over a local call."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return [self.value]


class LocalPolicy:
    """A local PolicyWorker behind the group interface the env worker calls (`policy.act(request)` -> handle)."""

    def __init__(self, worker):
        self.worker = worker

    def act(self, request):
        return Now(self.worker.act(request))


class Inbox:
    """A stand-in for the trajectory channel: keeps what the env worker puts."""

    def __init__(self):
        self.items = []

    def put(self, item, key=None):
        self.items.append(item)

    def get(self, key=None):
        return self.items.pop(0)

    @classmethod
    def of(cls, *items):
        box = cls()
        box.items.extend(items)
        return box


def rollouts(cfg, iterations=2):
    """Trajectories of `iterations` rollouts through a local env worker and policy worker."""
    env = EnvWorker(cfg)
    policy = PolicyWorker(cfg, *env.spaces())
    box, out = Inbox(), []
    for step in range(iterations):
        env.rollout(LocalPolicy(policy), box, cfg.rollout.steps, step, 1)
        out.append(box.items.pop()["traj"])
    return out, env, policy


NETWORK_OUTPUTS = ("logprobs", "values", "final_values", "next_values")


def assert_same(a: Trajectory, b: Trajectory):
    """Env data bit for bit; network outputs to float rounding (a matmul over 2 rows may round unlike one over 6)."""
    for name in Trajectory.__dataclass_fields__:
        if getattr(a, name) is None or getattr(b, name) is None:  # final_obs: recorded for off-policy runs only
            assert getattr(a, name) is getattr(b, name), name
            continue
        x, y = getattr(a, name), getattr(b, name).to(getattr(a, name).dtype)
        assert x.shape == y.shape, name
        if name in NETWORK_OUTPUTS:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(x, y), name


# --- stages and lockstep ---


def test_stages_change_timing_not_data():
    """1, 2 and 3 stages, a stochastic policy, obs + reward normalization, truncations: identical trajectories."""
    runs = [rollouts(make_cfg(env={"pipeline_stages": s}))[0] for s in (1, 2, 3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert_same(a, b)
    assert any(t.truncated.any() for t in runs[0]) and any(t.terminated.any() for t in runs[0])


def test_env_worker_equals_the_lockstep_reference():
    """Env worker + policy worker (deterministic, 2 stages) == collect_lockstep on the same envs and policy."""
    cfg = make_cfg(env={"pipeline_stages": 2}, rollout={"deterministic": True})
    (traj,), env, policy = rollouts(cfg, iterations=1)
    group = make_env_group(cfg, cfg.env.num_envs, cfg.run.seed)
    reference = collect_lockstep(group, lambda obs: policy.policy.act(obs, deterministic=True), cfg.rollout.steps,
                                 value_fn=policy.policy.value)
    assert_same(traj, reference)
    torch.testing.assert_close(env.group.state_dict()["obs.mean"], group.state_dict()["obs.mean"], rtol=0, atol=0)


def test_gae_on_real_rollout_with_truncations_matches_a_naive_loop():
    cfg = make_cfg()
    traj = rollouts(cfg, iterations=2)[0][1]  # the second rollout: it holds both kinds of episode end
    adv, returns, mask = advantages(traj, cfg)
    assert mask.all() and traj.truncated.any() and traj.terminated.any()
    assert (traj.final_values[traj.truncated] != 0).all() and (traj.final_values[~traj.truncated] == 0).all()
    g, lam = cfg.algorithm.gamma, cfg.algorithm.lam
    T, N = traj.rewards.shape
    expected = torch.zeros(T, N)
    for i in range(N):
        running = 0.0
        for t in reversed(range(T)):
            if traj.terminated[t, i]:
                nxt = 0.0
            elif traj.truncated[t, i]:
                nxt = float(traj.final_values[t, i])  # V(final obs): the truncated episode is bootstrapped
            else:
                nxt = float(traj.next_values[i] if t == T - 1 else traj.values[t + 1, i])
            delta = float(traj.rewards[t, i]) + g * nxt - float(traj.values[t, i])
            done = bool(traj.terminated[t, i] or traj.truncated[t, i])
            running = delta + g * lam * (0.0 if done else running)
            expected[t, i] = running
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns, expected + traj.values, rtol=1e-5, atol=1e-5)


def test_action_chunks_and_pixels_through_the_workers():
    """Chunks of 3 Box actions per policy step (HalfCheetah), and uint8 frames into a CNN policy: roll out, update."""
    for over in ({"env": {"id": "HalfCheetah-v5", "chunk": 3, "max_episode_steps": 10, "num_envs": 4,
                          "pipeline_stages": 2}, "rollout": {"steps": 8}},
                 {"env": {"id": BLINK_ENV, "pixels": True, "num_envs": 2, "norm_obs": False}, "policy": {"kind": "cnn"},
                  "rollout": {"steps": 6}}):
        cfg = make_cfg(**over)
        env = EnvWorker(cfg)
        policy, actor, box = PolicyWorker(cfg, *env.spaces()), EmbodiedActorWorker(cfg, *env.spaces()), Inbox()
        out = env.rollout(LocalPolicy(policy), box, cfg.rollout.steps, 0, 1)
        traj = box.items[0]["traj"]
        T, n = cfg.rollout.steps, cfg.env.num_envs
        if cfg.env.chunk > 1:
            assert traj.actions.shape == (T, n, 3, 6)  # episodes of 10 env steps = chunks of 3 + 3 + 3 + 1
            assert traj.truncated[[3, 7]].all() and traj.truncated.sum() == 2 * n and out["env_steps"] == n * 20
        else:
            assert traj.obs.shape == (T, n, 3, 64, 64) and traj.obs.dtype == torch.uint8
        metrics = actor.train(box, 0, 1)
        assert np.isfinite(metrics["actor/pg_loss"]) and metrics["actor/updates"] > 0


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_compiled_update_matches_eager():
    """actor.compile (torch.compile of the minibatch loss) changes speed, not the update: same metrics and weights
    over two iterations with an annealed clip range and a last, smaller minibatch (HalfCheetah, Gaussian policy)."""
    over = {"env": {"id": "HalfCheetah-v5", "num_envs": 4, "max_episode_steps": 10}, "rollout": {"steps": 20},
            "actor": {"epochs": 2, "minibatch_size": 32}, "algorithm": {"anneal_clip": True}, "run": {"steps": 4}}
    cfg = make_cfg(**over)
    env = EnvWorker(cfg)
    policy, box = PolicyWorker(cfg, *env.spaces()), Inbox()
    for step in range(2):
        env.rollout(LocalPolicy(policy), box, cfg.rollout.steps, step, 1)
    eager = EmbodiedActorWorker(cfg, *env.spaces())
    compiled = EmbodiedActorWorker(make_cfg(**C.merge(over, {"actor": {"compile": True}})), *env.spaces())
    assert compiled.loss_fn is not eager.loss_fn
    for step, item in enumerate(box.items):
        a, b = eager.train(Inbox.of(item), step, 1), compiled.train(Inbox.of(item), step, 1)
        assert a["actor/updates"] == b["actor/updates"] == 6 and a["actor/clip"] == b["actor/clip"]
        for k in ("actor/pg_loss", "actor/vf_loss", "actor/entropy", "actor/approx_kl", "actor/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    for (name, x), y in zip(eager.policy.state_dict().items(), compiled.policy.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6, msg=name)


# --- sampling ---


@pytest.mark.parametrize("env_id", ["CartPole-v1", "HalfCheetah-v5"])
def test_sampling_noise_belongs_to_the_env_not_the_batch(env_id):
    cfg = make_cfg(env={"id": env_id, "max_episode_steps": None})
    group = make_env_group(cfg, 6, 0)
    policy = make_policy(cfg, group.observation_space, group.action_space)
    obs = torch.as_tensor(group.reset())
    full = sample_actions(policy, obs, 99, 0, 6)
    for lo, hi in ((0, 2), (2, 5), (5, 6)):
        part = sample_actions(policy, obs[lo:hi], 99, lo, 6)
        assert torch.equal(part[0], full[0][lo:hi])  # actions: exact
        for x, y in zip(part[1:], full[1:]):  # logprobs, values: to float rounding across batch sizes
            torch.testing.assert_close(x, y[lo:hi], rtol=1e-5, atol=1e-6)
    _, logprob, value = full
    ref_logprob, _, ref_value = policy.evaluate(obs, full[0])
    torch.testing.assert_close(logprob, ref_logprob)
    torch.testing.assert_close(value, ref_value)
    assert not torch.equal(full[0], sample_actions(policy, obs, 100, 0, 6)[0])


def test_gumbel_and_gaussian_sampling_have_the_policy_distribution():
    space = spaces.Discrete(3)
    cfg = make_cfg()
    policy = make_policy(cfg, spaces.Box(-1, 1, (4,), np.float32), space)
    with torch.no_grad():
        policy.actor_head.bias.copy_(torch.tensor([0.0, 1.0, 2.0]))
    obs = torch.zeros(1, 4)
    draws = torch.stack([sample_actions(policy, obs, s, 0, 1)[0] for s in range(3000)]).flatten()
    probs = Categorical(logits=torch.tensor([0.0, 1.0, 2.0])).probs
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    box = make_policy(cfg, spaces.Box(-1, 1, (4,), np.float32), spaces.Box(-1, 1, (2,), np.float32))
    draws = torch.cat([sample_actions(box, obs, s, 0, 1)[0] for s in range(3000)])
    assert abs(float(draws.mean())) < 0.06 and abs(float(draws.std()) - 1.0) < 0.05  # N(0, exp(0)^2)
    assert isinstance(box._dist(box.features(obs)[0]), Normal)


# --- GRPO ---


def test_grpo_advantages_are_group_relative_on_each_envs_first_episode():
    cfg = make_cfg(algorithm={"name": "grpo", "norm_adv": False}, env={"num_envs": 8, "seed_groups": 4,
                                                                      "norm_obs": False, "norm_reward": False,
                                                                      "max_episode_steps": 200},
                   rollout={"steps": 60})
    env = EnvWorker(cfg)
    policy, box = PolicyWorker(cfg, *env.spaces()), Inbox()
    env.rollout(LocalPolicy(policy), box, cfg.rollout.steps, 0, 1)
    item = box.items.pop()
    traj, scores = item["traj"], item["scores"]
    obs0 = traj.obs[0]
    assert torch.equal(obs0[0], obs0[3]) and not torch.equal(obs0[0], obs0[4])  # groups of 4 share the reset seed
    done = traj.terminated | traj.truncated
    assert done.any(0).all()  # every env finished its first episode: its score is that episode's return
    lengths = done.float().argmax(0) + 1
    torch.testing.assert_close(scores, lengths.float())  # CartPole: return == length
    adv, _, mask = advantages(traj, cfg, scores)
    for g in range(2):
        s = scores[4 * g:4 * g + 4]
        z = (s - s.mean()) / (s.std() + 1e-6)
        for j in range(4):
            i = 4 * g + j
            steps = mask[:, i]
            assert steps.sum() == lengths[i]
            torch.testing.assert_close(adv[steps, i], z[j].expand(int(lengths[i])))
            assert (adv[~steps, i] == 0).all()
    actor = EmbodiedActorWorker(cfg, *env.spaces())
    metrics = actor.train(Inbox.of(item), 0, 1)  # the update trains on the first-episode steps only
    assert metrics["grpo/score_mean"] == pytest.approx(float(scores.mean())) and metrics["actor/updates"] > 0


def test_grpo_scores_sparse_success_once():
    cfg = make_cfg(algorithm={"name": "grpo", "norm_adv": False},
                   env={"id": REACH_ENV, "num_envs": 8, "seed_groups": 4, "norm_obs": False, "norm_reward": False,
                        "max_episode_steps": 6}, rollout={"steps": 6})
    env = EnvWorker(cfg)
    box = Inbox()
    out = env.rollout(LocalPolicy(PolicyWorker(cfg, *env.spaces())), box, cfg.rollout.steps, 0, 1)
    scores, traj = box.items[0]["scores"], box.items[0]["traj"]
    first = {}
    for e in out["episodes"]:
        first.setdefault(e["env_index"], e)
    assert set(scores.tolist()) <= {0.0, 1.0} and 0 < scores.sum() < 8  # some envs reached x = 3 in time
    for i, e in first.items():
        assert scores[i] == float(e["success_once"])
    adv = advantages(traj, cfg, scores)[0]
    assert (adv[0][scores == 1] > 0).all() and (adv[0][scores == 0] <= 0).all()


# --- checkpoints and evaluation ---


def test_checkpoint_round_trip_restores_weights_optimizer_and_normalizer(tmp_path, capsys):
    cfg = make_cfg()
    env = EnvWorker(cfg)
    policy, actor, box = PolicyWorker(cfg, *env.spaces()), EmbodiedActorWorker(cfg, *env.spaces()), Inbox()
    env.rollout(LocalPolicy(policy), box, cfg.rollout.steps, 0, 1)
    metrics = actor.train(box, 0, 1)
    assert metrics["actor/updates"] == 2 * 3 and np.isfinite(metrics["actor/vf_loss"])
    actor.save_checkpoint(str(tmp_path))
    env.save_state(str(tmp_path))
    C.save_yaml(cfg, tmp_path / "config.yaml")

    env2, actor2 = EnvWorker(cfg), EmbodiedActorWorker(cfg, *env.spaces())
    assert not torch.equal(env2.state_dict()["obs.mean"], env.state_dict()["obs.mean"])
    env2.load_state(str(tmp_path))
    actor2.load_checkpoint(str(tmp_path))
    for k, v in env.state_dict().items():
        assert torch.equal(env2.state_dict()[k], v), k
    for k, v in actor.policy.state_dict().items():
        assert torch.equal(actor2.policy.state_dict()[k], v), k
    s1, s2 = actor.optimizer.state_dict(), actor2.optimizer.state_dict()
    for p in s1["state"]:
        assert torch.equal(s1["state"][p]["exp_avg_sq"], s2["state"][p]["exp_avg_sq"])
    assert actor2.version == actor.version == 1
    box = Inbox()  # the next update on the same trajectories: the same minibatch order and the same weights
    env.rollout(LocalPolicy(policy), box, cfg.rollout.steps, 1, 2)
    ours, theirs = actor.train(box, 1, 1), actor2.train(box, 1, 1)
    ours.pop("time/update"), theirs.pop("time/update")
    assert ours == theirs
    for k, v in actor.policy.state_dict().items():
        assert torch.equal(actor2.policy.state_dict()[k], v), k

    result = evaluate_checkpoint(tmp_path, episodes=3)
    assert result["episodes"] == 3 and result["return_mean"] > 0 and "success_rate" not in result
    capsys.readouterr()
    assert evaluate_checkpoint(tmp_path, episodes=3) == result  # deterministic
    assert "evaluation: 3/3" in capsys.readouterr().err  # its progress, where stderr is no terminal
    assert evaluate_checkpoint(tmp_path, episodes=3, show=False) == result and not capsys.readouterr().err


def test_the_profilers_env_probe_builds_envs_only_when_their_count_changes():
    from m2flow.embodied.profiler import EnvProbe

    env = EnvProbe(make_cfg())
    launched = env.group
    env.resize(6)  # what it was launched with: kept
    assert env.group is launched and env.group.num_envs == 6
    env.resize(3)
    assert env.group is not launched and env.group.num_envs == 3 and env.cfg.env.seed_groups == 1
    smaller = env.group
    env.resize(3)
    assert env.group is smaller
    env.resize(6)  # back to the config's count: built again, with its seed groups
    assert env.group.num_envs == 6 and env.group is not smaller and env.cfg.env == make_cfg().env
    env.group.close()


def test_evaluation_records_a_video(tmp_path):
    cfg = make_cfg(env={"id": BLINK_ENV, "norm_obs": False, "norm_reward": False, "max_episode_steps": 12})
    actor = EmbodiedActorWorker(cfg, *EnvWorker(cfg).spaces())
    actor.save_checkpoint(str(tmp_path))
    C.save_yaml(cfg, tmp_path / "config.yaml")
    result = evaluate_checkpoint(tmp_path, episodes=2, video_dir=str(tmp_path / "video"))
    videos = list((tmp_path / "video").iterdir())
    assert result["length_mean"] == 12 and len(videos) == 1 and videos[0].stat().st_size > 0


# --- bad inputs ---


def test_unknown_env_id_lists_close_matches():
    with pytest.raises(ValueError, match=r"unknown gymnasium env id 'HalfCheeta-v5'.*HalfCheetah-v5"):
        EnvWorker(make_cfg(env={"id": "HalfCheeta-v5"}))


def test_action_space_mismatch_is_named(tmp_path):
    cfg = make_cfg()
    env = EnvWorker(cfg)

    class WrongActions:  # a policy for a Box action space driving CartPole's Discrete(2)
        def act(self, req):
            n = len(req["obs"])
            return Now({"actions": np.zeros((n, 1), np.float32), "logprobs": np.zeros(n, np.float32),
                        "values": np.zeros(n, np.float32), "final_values": None, "seconds": 0.0})

    with pytest.raises(ValueError, match=r"CartPole-v1: actions of shape \(6, 1\).*Discrete\(2\): expected shape"):
        env.rollout(WrongActions(), Inbox(), 4, 0, 1)
    cheetah = make_cfg(env={"id": "HalfCheetah-v5"})
    other = EmbodiedActorWorker(cheetah, *EnvWorker(cheetah).spaces())
    EmbodiedActorWorker(cfg, *env.spaces()).save_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="does not fit the policy of this config"):
        load_policy(other.policy, tmp_path)  # a CartPole checkpoint into a HalfCheetah policy


def test_nan_observation_names_env_index_and_step():
    cfg = make_cfg(env={"id": NAN_ENV, "num_envs": 2, "norm_obs": False, "norm_reward": False,
                        "max_episode_steps": None})
    env = EnvWorker(cfg)
    policy = PolicyWorker(cfg, *env.spaces())
    with pytest.raises(ValueError, match=rf"{NAN_ENV}: non-finite observation from env 1 at step \(env step 7"):
        env.rollout(LocalPolicy(policy), Inbox(), 20, 0, 1)


def test_config_errors_are_clear():
    with pytest.raises(C.ConfigError, match="policy.kind=cnn needs env.pixels=true"):
        make_cfg(policy={"kind": "cnn"})
    with pytest.raises(C.ConfigError, match="grpo needs env.seed_groups >= 2"):
        make_cfg(algorithm={"name": "grpo"})
    with pytest.raises(C.ConfigError, match="seed_groups=4 must divide"):
        make_cfg(env={"seed_groups": 4})
    with pytest.raises(C.ConfigError, match="unknown config field 'env.num_env'"):
        make_cfg(env={"num_env": 4})
    with pytest.raises(ValueError, match="pipeline_stages=7 exceeds the envs per env worker"):
        EnvWorker(make_cfg(env={"pipeline_stages": 7}))


def test_gradients_accumulate_into_one_flat_buffer_and_clip_like_torch():
    """flat_grads: backward writes into the buffer's views; the update's clipping equals clip_grad_norm_."""
    from m2flow.embodied.workers.actor import flat_grads

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    ref = [p.detach().clone().requires_grad_() for p in net.parameters()]
    x = torch.randn(11, 5)
    buf = flat_grads(list(net.parameters()))
    net(x).pow(2).sum().backward()
    names = [n for n, _ in net.named_parameters()]
    torch.func.functional_call(net, dict(zip(names, ref)), (x,)).pow(2).sum().backward()
    assert buf.abs().sum() > 0
    for p, r in zip(net.parameters(), ref):
        assert p.grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view of the buffer
        torch.testing.assert_close(p.grad, r.grad)
    norm = torch.linalg.vector_norm(buf)
    buf.mul_((0.1 / (norm + 1e-6)).clamp(max=1.0))
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.1)
    torch.testing.assert_close(norm, expected)
    for p, r in zip(net.parameters(), ref):
        torch.testing.assert_close(p.grad, r.grad)


def test_critic_warmup_iterations_train_the_value_function_alone():
    """`actor.critic_warmup=N`: iterations 0..N-1 leave the policy as it is and fit the critic; then both train."""
    cfg = make_cfg(actor={"critic_warmup": 1})
    env = EnvWorker(cfg)
    policy, box = PolicyWorker(cfg, *env.spaces()), Inbox()
    env.rollout(LocalPolicy(policy), box, cfg.rollout.steps, 0, 1)
    item = box.items.pop()
    actor = EmbodiedActorWorker(cfg, *env.spaces())

    def snapshot():
        return {k: v.clone() for k, v in actor.policy.state_dict().items()}

    def moved(before, after):
        return {k for k in before if not torch.equal(before[k], after[k])}

    start = snapshot()
    metrics = actor.train(Inbox.of(item), 0, 1)
    warm = snapshot()
    assert metrics["actor/critic_warmup"] == 1.0 and metrics["actor/pg_loss"] == 0.0 and metrics["actor/updates"] > 0
    assert moved(start, warm) and all(k.startswith("critic") for k in moved(start, warm)), moved(start, warm)
    warm_updates = metrics["actor/updates"]
    metrics = actor.train(Inbox.of(item), 1, 1)
    assert metrics["actor/critic_warmup"] == 0.0
    assert any(k.startswith("actor") for k in moved(warm, snapshot()))
    # Adam starts the policy's moments afresh after the warmup (its step count is the updates since), the critic's go on
    steps = {n: int(actor.optimizer.state[p]["step"]) for n, p in actor.policy.named_parameters()}
    assert steps["actor_head.weight"] == steps["actor.0.weight"] == metrics["actor/updates"]
    assert steps["critic_head.weight"] == warm_updates + metrics["actor/updates"]
    with pytest.raises(C.ConfigError, match="actor.critic_warmup must be >= 0, got -1"):
        make_cfg(actor={"critic_warmup": -1})


def test_critic_lr_gives_the_value_functions_own_parameters_their_own_rate():
    """`actor.critic_lr`: the critic network and the value head train at their own rate (annealed as actor.lr is),
    the policy's parameters at actor.lr; null keeps one group. PPO's only."""
    from m2flow.embodied.workers.actor import value_param_groups

    cfg = make_cfg(actor={"lr": 1e-9, "critic_lr": 1e-2, "anneal_lr": True})
    env = EnvWorker(cfg)
    policy, box = PolicyWorker(cfg, *env.spaces()), Inbox()
    env.rollout(LocalPolicy(policy), box, cfg.rollout.steps, 0, 1)
    item = box.items.pop()
    actor = EmbodiedActorWorker(cfg, *env.spaces())
    names = {id(p): n for n, p in actor.policy.named_parameters()}
    fast = sorted(names[id(p)] for p in actor.optimizer.param_groups[1]["params"])
    assert fast == sorted(n for n in names.values() if n.startswith(("critic.", "critic_head.")))
    assert len(fast) + len(actor.optimizer.param_groups[0]["params"]) == len(names)
    before = {k: v.clone() for k, v in actor.policy.state_dict().items()}
    metrics = actor.train(Inbox.of(item), 0, 1)
    change = {k: float((v - before[k]).abs().max()) for k, v in actor.policy.state_dict().items()}
    assert min(change[n] for n in fast) > 1e-4 > 1e-6 > max(v for k, v in change.items() if k not in fast)
    frac = 1.0 - 0 / cfg.run.steps
    assert metrics["actor/lr"] == pytest.approx(1e-9 * frac)
    assert metrics["actor/critic_lr"] == pytest.approx(1e-2 * frac)
    assert len(value_param_groups(actor.policy, 1e-3, None)) == 1
    with pytest.raises(ValueError, match="has no value-function parameters of its own"):
        value_param_groups(torch.nn.Linear(2, 2), 1e-3, 1e-2)
    with pytest.raises(C.ConfigError, match="actor.critic_lr is the learning rate of PPO's value function; "
                                            "algorithm.name=grpo"):
        make_cfg(actor={"critic_lr": 1e-3}, algorithm={"name": "grpo"}, env={"seed_groups": 2})


def test_policy_init_critic_false_starts_the_value_function_afresh(tmp_path):
    """`policy.init` with `policy.init_critic=false`: the actor starts from the checkpoint's policy and from its own
    initialization for the value function (the critic MLP and the value head); by default it loads both."""
    cfg = make_cfg(run={"seed": 5})
    env = EnvWorker(cfg)
    saved = EmbodiedActorWorker(cfg, *env.spaces())
    with torch.no_grad():
        for p in saved.policy.parameters():
            p.add_(1.0)  # unlike any fresh initialization
    saved.save_checkpoint(str(tmp_path))
    fresh = EmbodiedActorWorker(cfg, *env.spaces()).policy.state_dict()
    both = EmbodiedActorWorker(make_cfg(run={"seed": 5}, policy={"init": str(tmp_path)}), *env.spaces())
    policy_only = EmbodiedActorWorker(make_cfg(run={"seed": 5}, policy={"init": str(tmp_path), "init_critic": False}),
                                      *env.spaces())
    ckpt = saved.policy.state_dict()
    assert all(torch.equal(v, ckpt[k]) for k, v in both.policy.state_dict().items())
    critic = [k for k in ckpt if k.startswith(("critic.", "critic_head."))]
    assert critic and len(critic) < len(ckpt)
    for k, v in policy_only.policy.state_dict().items():
        assert torch.equal(v, fresh[k] if k in critic else ckpt[k]), k
