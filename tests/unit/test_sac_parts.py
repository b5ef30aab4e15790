"""SAC's parts below the flow: the squashed-Gaussian actor (bounds, log-probabilities, the seeded sampler the policy
worker uses), the uniform warm-up actions, the sac config section's errors, RLPD's demonstration transitions and
minibatches."""

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from gymnasium import spaces

from m2flow import config as C
from m2flow.algorithms import actor_loss, polyak_update, squashed_gaussian_logprob
from m2flow.embodied.bc import demo_transitions
from m2flow.embodied.config import EmbodiedConfig
from m2flow.embodied.envs import Trajectory
from m2flow.embodied.envs.experts import load_demos
from m2flow.embodied.policies import Critics, SquashedGaussianActor
from m2flow.embodied.sac import parallel as sac_parallel
from m2flow.embodied.sac.learner import SACLearnerWorker, SerialSteps
from m2flow.embodied.workers.policy import make_policy, sample_actions, uniform_actions

BOX = spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32))


def test_actions_stay_in_the_boxs_bounds_and_map_back_to_the_unit_cube():
    torch.manual_seed(0)
    actor = SquashedGaussianActor(3, BOX, hidden=(16,))
    obs = torch.randn(500, 3) * 10
    action, logp, value = actor.act(obs)
    assert action.shape == (500, 2) and logp.shape == (500,) and not value.any()
    assert (action[:, 0].abs() <= 2).all() and (action[:, 1] >= 0).all() and (action[:, 1] <= 1).all()
    unit = actor.to_unit(action)
    assert unit.abs().max() <= 1 + 1e-6
    assert torch.allclose(actor.to_env(unit), action, atol=1e-6)
    mode = actor.act(obs[:4], deterministic=True)[0]
    mean, _ = actor.dist(obs[:4])
    assert torch.allclose(mode, actor.to_env(torch.tanh(mean)))


def test_sample_gives_the_squashed_gaussians_log_probability_and_gradients():
    torch.manual_seed(1)
    actor = SquashedGaussianActor(3, BOX, hidden=(16,))
    obs, eps = torch.randn(4, 3), torch.randn(4, 2)
    unit, logp = actor.sample(obs, eps)
    mean, log_std = actor.dist(obs)
    u = mean + log_std.exp() * eps
    assert torch.allclose(unit, torch.tanh(u)) and torch.allclose(logp, squashed_gaussian_logprob(u, mean, log_std))
    logp.sum().backward()
    assert actor.mu.weight.grad is not None and actor.log_std_head.weight.grad.abs().sum() > 0


def test_the_policy_workers_sampler_gives_each_env_the_same_action_in_any_stage_split():
    cfg = C.load(EmbodiedConfig, {"algorithm": {"name": "sac"}, "policy": {"hidden": [16]}})
    actor = make_policy(cfg, spaces.Box(-1, 1, (3,), np.float32), BOX)
    assert isinstance(actor, SquashedGaussianActor)
    obs = torch.randn(6, 3)
    whole = sample_actions(actor, obs, 123, 0, 6)[0]
    parts = torch.cat([sample_actions(actor, obs[:2], 123, 0, 6)[0], sample_actions(actor, obs[2:], 123, 2, 6)[0]])
    assert torch.allclose(whole, parts, atol=1e-6)  # the same noise (matmuls of other batch sizes may round apart)
    assert not torch.allclose(whole, sample_actions(actor, obs, 124, 0, 6)[0], atol=1e-3)


def test_uniform_warmup_actions_cover_the_box_and_split_by_env_like_the_policy():
    a = uniform_actions(BOX, 7, 0, 4000, 4000)
    assert a.dtype == np.float32 and a.shape == (4000, 2)
    assert a[:, 0].min() > -2.0 and a[:, 0].max() < 2.0 and abs(a[:, 0].mean()) < 0.1
    assert abs(a[:, 1].mean() - 0.5) < 0.03
    assert np.array_equal(uniform_actions(BOX, 7, 10, 5, 4000), a[10:15])


def test_the_critics_are_separate_networks_and_a_subset_runs_alone():
    q = Critics(3, 2, hidden=(8,))
    assert q(torch.zeros(5, 3), torch.zeros(5, 2)).shape == (2, 5) and not torch.equal(q.qs[0][1].weight,
                                                                                         q.qs[1][1].weight)
    ens = Critics(3, 2, hidden=(8,), n=10)
    obs, act = torch.randn(5, 3), torch.rand(5, 2)
    whole = ens(obs, act)
    assert whole.shape == (10, 5) and torch.equal(ens(obs, act, [7, 2]), whole[[7, 2]])


def test_critic_layernorm_bounds_q_whatever_the_inputs_scale():
    """sac.critic_layernorm: each hidden layer is normalized, so |Q| stays under the output layer's |w|_1 + |b| for
    inputs a million times too large, where the plain critics' Q grows with them; the flag reaches the learner."""
    torch.manual_seed(0)
    plain, normed = Critics(3, 2, hidden=(16, 16)), Critics(3, 2, hidden=(16, 16), layernorm=True)
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in normed.modules()) == 4  # 2 hidden layers x 2 critics
    obs, act = torch.randn(64, 3) * 1e6, torch.rand(64, 2) * 2 - 1
    for q, head in zip(normed(obs, act), (normed.qs[0][-1], normed.qs[1][-1])):
        bound = head.weight.abs().sum() * 16 ** 0.5 + head.bias.abs()  # LayerNorm'd ReLU features: |f|_2 <= sqrt(16)
        assert q.abs().max() <= bound
    assert max(q.abs().max() for q in plain(obs, act)) > 1e4
    cfg = C.load(EmbodiedConfig, "sac_pendulum", ["policy.hidden=[8]", "sac.critic_layernorm=true"])
    learner = SACLearnerWorker(cfg, spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-2, 2, (1,), np.float32))
    assert [type(m).__name__ for m in learner.target.qs[0]] == ["Sequential", "Linear"]
    assert isinstance(learner.target.qs[0][0][1], torch.nn.LayerNorm) and isinstance(learner.critic.qs[1][0][1],
                                                                                     torch.nn.LayerNorm)


def test_sac_needs_a_bounded_box():
    with pytest.raises(ValueError, match="bounded Box"):
        SquashedGaussianActor(3, spaces.Discrete(2))
    with pytest.raises(ValueError, match="bounded Box"):
        SquashedGaussianActor(3, spaces.Box(-np.inf, np.inf, (2,)))


@pytest.mark.parametrize("override, message", [
    ("sac.ent_coef=hot", "sac.ent_coef must be a number, 'auto' or 'auto_X', got 'hot'"),
    ("sac.ent_coef=auto_-1", "sac.ent_coef must be > 0"),
    ("sac.target_entropy=high", "sac.target_entropy must be 'auto' or a number"),
    ("sac.gradient_steps=0", "sac.gradient_steps must be >= 1 or -1"),
    ("sac.tau=0", r"sac.tau must be in \(0, 1\]"),
    ("sac.max_policy_lag=2", r"sac.max_policy_lag must be in \[0, 1\], got 2"),
    ("env.chunk=2", "algorithm.name=sac needs policy.kind=mlp, env.chunk=1"),
    ("sac.bc_coef=1", "sac.bc_coef > 0 needs sac.demos"),
    ("sac.utd=0", "sac.utd must be > 0, got 0.0"),
    ("sac.save_buffer=some", "sac.save_buffer must be latest | all | none, got 'some'"),
    ("sac.actor_q=max", "sac.actor_q must be min | mean, got 'max'"),
    ("sac.min_qs=3", r"sac.min_qs must be null or in \[1, n_critics = 2\], got 3"),
    ("sac.n_critics=0", "n_critics must be >= 1"),
])
def test_bad_sac_settings_name_the_field(override, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load(EmbodiedConfig, "sac_pendulum", [override])


def test_the_temperature_and_entropy_settings_parse():
    s = C.load(EmbodiedConfig, "sac_pendulum", ["sac.ent_coef=auto_0.1", "sac.target_entropy=-3"]).sac
    assert s.alpha_init() == (0.1, True) and s.target(6) == -3.0
    s = C.load(EmbodiedConfig, "sac_pendulum", ["sac.ent_coef=0.2"]).sac
    assert s.alpha_init() == (0.2, False) and s.target(6) == -6.0


FIXTURE = str(Path(__file__).resolve().parents[1] / "fixtures" / "demos" / "PickCube-v1")


def test_demonstrations_become_transitions_that_end_terminated_with_the_sparse_reward_relabelled():
    summary, arrays = load_demos(FIXTURE)
    first = [e["length"] for e in summary["episodes"][:3]]
    dense = demo_transitions(FIXTURE, "PickCube-v1", episodes=3)
    sparse = demo_transitions(FIXTURE, "PickCube-v1", episodes=3, sparse=True)
    n = sum(first)
    assert len(dense["rewards"]) == n and dense["obs"].shape == (n, 42)
    ends = torch.tensor(first).cumsum(0) - 1
    assert torch.equal(torch.nonzero(dense["terminated"]).squeeze(1), ends)
    assert torch.equal(sparse["rewards"], sparse["terminated"].float())  # 1 on each episode's last step only
    assert torch.allclose(dense["rewards"], torch.as_tensor(arrays["rewards"][:n], dtype=torch.float32))
    # next obs is the episode's next row, never the next episode's first
    assert torch.equal(dense["next_obs"][:first[0] - 1], dense["obs"][1:first[0]])
    # an env that runs on past success (ignore_terminations): nothing is terminated, the last step bootstraps
    running = demo_transitions(FIXTURE, "PickCube-v1", episodes=3, end_at_success=False)
    assert not running["terminated"].any() and torch.equal(running["rewards"], dense["rewards"])
    assert torch.equal(running["next_obs"][ends], running["obs"][ends])
    with pytest.raises(ValueError, match="env.id is PushCube-v1"):
        demo_transitions(FIXTURE, "PushCube-v1")


def test_rlpd_minibatches_draw_their_demo_fraction_from_the_demonstrations():
    cfg = C.load(EmbodiedConfig, {"env": {"id": "PickCube-v1"}, "algorithm": {"name": "sac"},
                                    "policy": {"hidden": [16]},
                                    "sac": {"buffer_size": 1000, "demos": FIXTURE, "demo_fraction": 0.25}})
    learner = SACLearnerWorker(cfg, spaces.Box(-np.inf, np.inf, (42,), np.float32),
                               spaces.Box(-1, 1, (4,), np.float32))
    episodes = json.loads(Path(FIXTURE, "demos.json").read_text())["episodes"]
    assert len(learner.demos) == sum(e["length"] for e in episodes)
    online = {"obs": torch.full((10, 42), 7.0), "actions": torch.zeros(10, 4), "rewards": torch.zeros(10),
              "next_obs": torch.full((10, 42), 7.0), "terminated": torch.zeros(10, dtype=torch.bool)}
    learner.buffer.add(online)
    batch = learner._sample(64)
    from_online = (batch["obs"] == 7.0).all(1)
    assert from_online.sum() == 48 and not from_online[:16].any()
    with pytest.raises(C.ConfigError, match="demo_fraction must be in"):
        C.load(EmbodiedConfig, "sac_pendulum", ["sac.demo_fraction=1"])


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_non_finite_critic_loss_stops_or_is_dropped_before_anything_steps(mode, parallel):
    cfg = C.load(EmbodiedConfig, "sac_pendulum", ["policy.hidden=[8]", "sac.buffer_size=100", "sac.batch_size=4",
                                                    "sac.learning_starts=8", f"actor.nonfinite={mode}",
                                                    f"sac.parallel_update={parallel}"])
    learner = SACLearnerWorker(cfg, spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-2, 2, (1,), np.float32))
    learner.buffer.add({"obs": torch.zeros(8, 3), "actions": torch.zeros(8, 1), "rewards": torch.full((8,), np.nan),
                        "next_obs": torch.zeros(8, 3), "terminated": torch.zeros(8, dtype=torch.bool)})
    learner.env_steps = 1000  # past learning_starts
    nets = [learner.policy, learner.critic, learner.target]
    before = [{k: v.clone() for k, v in n.state_dict().items()} for n in nets]
    alpha = learner.log_alpha.item()
    if mode == "stop":
        with pytest.raises(FloatingPointError, match="the critics' loss"):
            learner._updates(0, 5)
    else:
        out = learner._updates(0, 5)
        assert out["actor/nonfinite_skipped"] == 5 and out["sac/updates"] == 0
    assert learner.log_alpha.item() == alpha  # the temperature, the critics, the actor, the targets: untouched
    assert all(torch.equal(v, n.state_dict()[k]) for n, b in zip(nets, before) for k, v in b.items())


def _pendulum_learner(*overrides):
    cfg = C.load(EmbodiedConfig, "sac_pendulum", ["policy.hidden=[16,16]", "sac.buffer_size=200", "sac.batch_size=32",
                                                    *overrides])
    learner = SACLearnerWorker(cfg, spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-2, 2, (1,), np.float32))
    g = torch.Generator().manual_seed(3)
    learner.buffer.add({"obs": torch.randn(200, 3, generator=g), "actions": torch.rand(200, 1, generator=g) * 2 - 1,
                        "rewards": torch.randn(200, generator=g), "next_obs": torch.randn(200, 3, generator=g),
                        "terminated": torch.rand(200, generator=g) < 0.1})
    learner.env_steps = 1000  # past learning_starts
    return learner


def _weights(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_parallel_update_steps_the_actor_through_the_critics_before_their_update():
    """sac.parallel_update: the critics, targets and temperature step exactly as in the sequential step; the actor's
    gradient reads the critics as they were before this step (a hand-written reference), not after (SB3)."""
    par, seq, ref = (_pendulum_learner(*o) for o in (["sac.parallel_update=true"], [], []))
    assert isinstance(par.steps, sac_parallel.ThreadedManual) and isinstance(seq.steps, SerialSteps)  # grad=auto: manual
    par.steps.run(1)
    seq.steps.run(1)
    for net in ("critic", "target"):
        a, b = _weights(getattr(par, net)), _weights(getattr(seq, net))
        assert all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in a), net
    assert par.log_alpha.item() == pytest.approx(seq.log_alpha.item(), rel=1e-6)
    # the reference actor step: the same minibatch and noise, the loss through the critics not yet stepped
    b = ref._sample(32)
    eps = torch.randn((2, 32, 1), generator=ref.gen)
    alpha = ref.log_alpha.detach().exp()
    pi, logp = ref.policy.sample(b["obs"], eps[0])
    ref.actor_opt.zero_grad()
    actor_loss(logp, ref.critic(b["obs"], pi), alpha).backward()
    ref.actor_opt.step()
    # Adam's first step is the gradient's sign, so compare the gradients the steps applied
    want, got, sb3 = ([p.grad.clone() for p in x.policy.parameters()] for x in (ref, par, seq))
    assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-7) for g, w in zip(got, want))
    assert not all(torch.allclose(g, w, rtol=1e-3) for g, w in zip(sb3, want))  # SB3's order reads the new critics
    assert all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)  # the critics' gradient: their loss's only
               for p, q in zip(par.critic.parameters(), seq.critic.parameters()))


def test_parallel_steps_equal_their_sequential_reference_over_several_steps():
    """sac.parallel_update over 3 steps equals a one-thread reference of the same order: the actor's gradient through
    the critics before the step, the critics' step, the temperature's and the actor's, then the targets; with as
    many draws from each generator, so the next steps' minibatches and noise are the sequential step's."""
    par, ref = _pendulum_learner("sac.parallel_update=true"), _pendulum_learner()
    assert par._updates(0, 3)["sac/updates"] == 3
    for _ in range(3):
        b = ref._sample(32)
        eps = torch.randn((2, 32, 1), generator=ref.gen)
        alpha = ref.log_alpha.detach().exp()
        ref.actor_opt.zero_grad()
        pi, logp = ref.policy.sample(b["obs"], eps[0])
        torch.autograd.backward(actor_loss(logp, ref.critic(b["obs"], pi), alpha), inputs=list(ref.policy.parameters()))
        c_loss, _ = ref.critic_objective(b, eps[1], alpha)
        ref.critic_opt.zero_grad()
        c_loss.backward()
        ref.critic_opt.step()
        ref.temperature_step(logp)
        ref.actor_opt.step()
        polyak_update(list(ref.target.parameters()), list(ref.critic.parameters()), ref.cfg.sac.tau)
    for net in ("policy", "critic", "target"):
        a, w = _weights(getattr(par, net)), _weights(getattr(ref, net))
        assert all(torch.allclose(a[k], w[k], rtol=1e-5, atol=1e-6) for k in a), net
    assert par.log_alpha.item() == pytest.approx(ref.log_alpha.item(), rel=1e-6)
    assert torch.equal(par.gen.get_state(), ref.gen.get_state())  # as many draws, in the same order
    assert torch.equal(par.buffer.gen.get_state(), ref.buffer.gen.get_state())


@pytest.mark.parametrize("grad, thread_fn", [("autograd", "actor_gradient"), ("manual", "actor_steps")])
def test_parallel_update_is_deterministic_and_uses_half_the_threads_in_each_of_its_two(grad, thread_fn):
    runs = []
    for _ in range(2):
        learner = _pendulum_learner("sac.parallel_update=true", f"sac.grad={grad}")
        threads, seen, gradient = torch.get_num_threads(), [], getattr(learner.steps, thread_fn)

        def watched(*args):
            out = gradient(*args)
            seen.append((threading.get_ident(), torch.get_num_threads()))
            return out

        setattr(learner.steps, thread_fn, watched)
        out = learner._updates(0, 20)
        assert torch.get_num_threads() == threads  # restored after the updates
        assert learner.steps.threads == max(1, threads // 2)
        assert {s for s in seen} == {(seen[0][0], learner.steps.threads)} and seen[0][0] != threading.get_ident()
        runs.append((out, _weights(learner.policy), _weights(learner.critic)))
    assert runs[0][0] == runs[1][0] and runs[0][0]["sac/updates"] == 20
    for i in (1, 2):
        assert all(torch.equal(runs[0][i][k], runs[1][i][k]) for k in runs[0][i])


def test_an_error_in_the_actor_thread_surfaces_from_the_update_and_leaves_the_pool_usable(monkeypatch):
    """sac.grad=manual's parallel step: the critics' thread waits on the actor's thread for the next actions; when
    that thread fails first, its error surfaces from the update (no wait left hanging) and the next update runs."""
    learner = _pendulum_learner("sac.parallel_update=true", "sac.grad=manual")
    sample = sac_parallel.squashed_sample

    def broken(*args):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the actor's forward broke")
        return sample(*args)

    monkeypatch.setattr(sac_parallel, "squashed_sample", broken)
    with pytest.raises(RuntimeError, match="the actor's forward broke"):
        learner._updates(0, 1)
    monkeypatch.setattr(sac_parallel, "squashed_sample", sample)
    assert learner._updates(0, 2)["sac/updates"] == 2


@pytest.mark.parametrize("parallel", [False, True])
def test_bc_coef_pulls_the_actor_to_the_demonstrated_actions(parallel):
    """sac.bc_coef adds the squared error of the deterministic action on the demonstration rows to the actor's loss
    (in either update): with it the actor imitates the demonstrations within 60 gradient steps; without it, not."""
    errors = {}
    for coef in (0.0, 10.0):
        cfg = C.load(EmbodiedConfig, {"env": {"id": "PickCube-v1"}, "algorithm": {"name": "sac"},
                                        "policy": {"hidden": [32, 32]}, "actor": {"lr": 3e-3},
                                        "sac": {"buffer_size": 1000, "demos": FIXTURE, "batch_size": 64,
                                                "bc_coef": coef, "parallel_update": parallel}})
        learner = SACLearnerWorker(cfg, spaces.Box(-np.inf, np.inf, (42,), np.float32),
                                   spaces.Box(-1, 1, (4,), np.float32))
        g = torch.Generator().manual_seed(0)
        learner.buffer.add({"obs": torch.randn(100, 42, generator=g), "rewards": torch.zeros(100),
                            "actions": torch.rand(100, 4, generator=g) * 2 - 1,
                            "next_obs": torch.randn(100, 42, generator=g),
                            "terminated": torch.zeros(100, dtype=torch.bool)})
        learner.env_steps = 1000
        demo = learner.demos.sample(len(learner.demos))

        def mse():
            with torch.no_grad():
                return float((torch.tanh(learner.policy.dist(demo["obs"])[0]) - demo["actions"]).pow(2).sum(-1).mean())

        before = mse()
        out = learner._updates(0, 60)
        errors[coef] = (before, mse())
        assert ("sac/bc_loss" in out) == bool(coef)
    assert errors[10.0][1] < 0.5 * errors[10.0][0]
    assert errors[10.0][1] < 0.5 * errors[0.0][1]


def _bc_learner(*overrides):
    """A PickCube learner with the demonstrations (RLPD's half-and-half minibatches) and 100 random online rows."""
    cfg = C.load(EmbodiedConfig, {"env": {"id": "PickCube-v1"}, "algorithm": {"name": "sac"},
                                    "policy": {"hidden": [32, 32], "activation": "relu"},
                                    "sac": {"buffer_size": 1000, "demos": FIXTURE, "batch_size": 64}}, list(overrides))
    learner = SACLearnerWorker(cfg, spaces.Box(-np.inf, np.inf, (42,), np.float32), spaces.Box(-1, 1, (4,), np.float32))
    g = torch.Generator().manual_seed(0)
    learner.buffer.add({"obs": torch.randn(100, 42, generator=g), "rewards": torch.rand(100, generator=g),
                        "actions": torch.rand(100, 4, generator=g) * 2 - 1,
                        "next_obs": torch.randn(100, 42, generator=g), "terminated": torch.zeros(100, dtype=torch.bool)})
    learner.env_steps = 1000
    return learner


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("case", ["rlpd_critics", "bc"])
def test_manual_gradients_train_rlpds_critics_and_the_bc_term_as_autograd_does(case, parallel):
    """sac.grad=manual takes RLPD's parts (LayerNorm critics, an ensemble with a random min over 2 of its target
    critics, the actor scored by their mean; the BC term on the demonstration rows): 10 gradient steps leave every
    weight, the temperature and the stats where autograd's do, to float rounding, in either update order."""
    extra = {"rlpd_critics": ["sac.critic_layernorm=true", "sac.n_critics=4", "sac.min_qs=2", "sac.actor_q=mean"],
             "bc": ["sac.bc_coef=2.0", "sac.critic_layernorm=true"]}[case] + [f"sac.parallel_update={parallel}"]
    make = _pendulum_learner if case == "rlpd_critics" else _bc_learner
    manual, auto = make(*extra, "sac.grad=manual"), make(*extra, "sac.grad=autograd")
    assert manual.manual is not None and auto.manual is None
    outs = [learner._updates(0, 10) for learner in (manual, auto)]
    assert outs[0].keys() == outs[1].keys() and outs[0]["sac/updates"] == 10
    assert ("sac/bc_loss" in outs[0]) == (case == "bc")
    for key in outs[0]:
        assert outs[0][key] == pytest.approx(outs[1][key], rel=1e-4, abs=1e-6), key
    for net in ("policy", "critic", "target"):
        a, w = _weights(getattr(manual, net)), _weights(getattr(auto, net))
        assert all(torch.allclose(a[k], w[k], rtol=1e-4, atol=1e-5) for k in a), net
    assert manual.log_alpha.item() == pytest.approx(auto.log_alpha.item(), rel=1e-5)


def _same_learners(a, b) -> None:
    """Every weight, Adam state, the temperature and the generators of two learners equal, bit for bit."""
    for net in ("policy", "critic", "target"):
        x, y = _weights(getattr(a, net)), _weights(getattr(b, net))
        assert all(torch.equal(x[k], y[k]) for k in x), net
    for opt in ("actor_opt", "critic_opt"):
        x, y = (getattr(learner, opt).state_dict()["state"] for learner in (a, b))
        assert all(torch.equal(x[i][k], y[i][k]) for i in x for k in x[i]), opt
    assert a.log_alpha.item() == b.log_alpha.item()
    assert torch.equal(a.gen.get_state(), b.gen.get_state())
    assert torch.equal(a.buffer.gen.get_state(), b.buffer.gen.get_state())


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
@pytest.mark.parametrize("case", ["twin", "rlpd_critics", "bc"])
def test_the_actor_process_takes_the_threaded_steps_bit_for_bit(case, tmp_path):
    """sac.actor_process: the actor's side of the pipelined step in its own process gives the threaded step's
    numbers exactly (the same ops in the same order, the minibatches drawn in the learner in the same order), over
    two calls, and again after the learner loads a checkpoint (which replaces the optimizers' state: the process is
    started anew on it). The process starts in the warm-up, before learning_starts, so that its start-up overlaps
    the collection."""
    extra = {"twin": [], "rlpd_critics": ["sac.critic_layernorm=true", "sac.n_critics=4", "sac.min_qs=2",
                                          "sac.actor_q=mean"],
             "bc": ["sac.bc_coef=2.0", "sac.critic_layernorm=true"]}[case] + ["sac.parallel_update=true"]
    make = _bc_learner if case == "bc" else _pendulum_learner
    thread, proc = make(*extra), make(*extra, "sac.actor_process=true")
    try:
        steps, proc.env_steps = proc.env_steps, 0  # the warm-up: no gradient step, the process started
        assert proc._updates(0, 7) == {"sac/updates": 0} and proc.steps.process.proc.poll() is None
        proc.env_steps = steps
        for _ in range(2):
            assert proc._updates(0, 7) == thread._updates(0, 7)
        _same_learners(thread, proc)
        child = proc.steps.process.proc
        assert child.poll() is None
        for learner, name in ((thread, "t"), (proc, "p")):
            (tmp_path / name).mkdir()
            learner.save_checkpoint(str(tmp_path / name))
            learner.load_checkpoint(str(tmp_path / name))
        assert proc.steps.process is None and child.wait(10) is not None  # ended with the state it shared
        assert proc._updates(0, 5) == thread._updates(0, 5)
        _same_learners(thread, proc)
    finally:
        proc.steps.reset()


@pytest.mark.slow  # over ~4 s: in `make test`, not in `make check`
def test_an_error_in_the_actor_process_surfaces_from_the_update_with_its_traceback(monkeypatch, tmp_path):
    """The actor's process failing mid-call (its forward raising, through a sitecustomize on the path it is given),
    or killed between calls: the learner's update raises with the process's traceback or its exit, never hangs, and
    the next update starts a new process and trains."""
    learner = _pendulum_learner("sac.parallel_update=true", "sac.actor_process=true")
    (tmp_path / "sitecustomize.py").write_text(
        "import m2flow.algorithms.sac_grad as g\n"
        "def broken(*args):\n    raise RuntimeError('the actor forward broke')\n"
        "g.squashed_sample = broken\n")
    try:
        with monkeypatch.context() as m:
            m.syspath_prepend(str(tmp_path))
            with pytest.raises(RuntimeError, match=r"(?s)actor's process.*Traceback.*the actor forward broke"):
                learner._updates(0, 3)
        assert learner.steps.process is None
        assert learner._updates(0, 3)["sac/updates"] == 3
        learner.steps.process.proc.kill()
        learner.steps.process.proc.wait(10)
        with pytest.raises(RuntimeError, match=r"actor's process .* ended during the update:\nexit code -9"):
            learner._updates(0, 3)
        assert learner._updates(0, 3)["sac/updates"] == 3
    finally:
        learner.steps.reset()


def test_the_actor_process_needs_the_parallel_manual_step():
    with pytest.raises(C.ConfigError, match=r"sac.actor_process .* needs sac.parallel_update=true .* "
                                            r"\(got parallel_update=False, grad=auto\)"):
        C.load(EmbodiedConfig, "sac_pendulum", ["sac.actor_process=true"])
    with pytest.raises(C.ConfigError, match=r"got parallel_update=True, grad=auto; policy.activation is 'tanh'"):
        C.load(EmbodiedConfig, "sac_pendulum", ["sac.actor_process=true", "sac.parallel_update=true",
                                                  "policy.activation=tanh"])


class _Steps:
    """An input channel holding one env worker's iteration of 8 envs x 8 steps (64 transitions) of Pendulum."""

    def get(self, key):
        t, n, zeros, flags = 8, 8, torch.zeros(8, 8), torch.zeros(8, 8, dtype=torch.bool)
        traj = Trajectory(obs=torch.randn(t, n, 3), actions=torch.zeros(t, n, 1), logprobs=zeros, values=zeros,
                          rewards=zeros, terminated=flags, truncated=flags, final_values=zeros,
                          next_obs=torch.randn(n, 3), next_values=torch.zeros(n), final_obs=torch.zeros(t, n, 3))
        return {"env_rank": 0, "traj": traj}


def test_the_updates_start_once_more_than_learning_starts_env_steps_were_collected():
    """SB3's condition (`num_timesteps > learning_starts`): with learning_starts=64 and 64 env steps an iteration, the
    first iteration only collects and the second updates; with 63 the first updates."""
    for starts, want in ((64, [0, 64, 64]), (63, [64, 64, 64])):
        learner = _pendulum_learner(f"sac.learning_starts={starts}", "sac.max_policy_lag=0")
        learner.env_steps = 0  # (its buffer holds 200 rows already: more than learning_starts)
        outs = [learner.train(_Steps(), k, 1) for k in range(3)]
        assert [o["sac/updates"] for o in outs] == want, starts
        assert [o["time/gradient_steps"] > 0 for o in outs] == [n > 0 for n in want]  # 0.0 in an iteration without


@pytest.mark.parametrize("lag", [0, 1])
def test_utd_sets_the_gradient_steps_per_env_step_in_either_order(lag):
    """sac.utd replaces gradient_steps: an iteration of 8 envs x 8 steps takes utd x 64 gradient steps, at lag 0 (on
    the steps just taken in) and at lag 1 (a whole iteration's, taken in after)."""
    for utd, want in ((0.5, 32), (2, 128), (None, 64)):
        extra = [f"sac.utd={utd}"] if utd is not None else []
        learner = _pendulum_learner(f"sac.max_policy_lag={lag}", "sac.learning_starts=0", *extra)
        out = learner.train(_Steps(), 0, 1)
        assert out["sac/updates"] == want
        # the updates' own seconds, within the call's (which takes the trajectories in, too)
        assert 0 < out["time/gradient_steps"] < out["time/update"]


def test_an_ensembles_step_takes_the_target_over_a_fresh_random_pair_and_scores_the_actor_with_the_mean():
    """sac.n_critics=5, min_qs=2, actor_q=mean (RLPD's choices): the critics' loss regresses all five on a target
    that is the min over two target critics drawn from the learner's generator (a hand-written reference), a
    different pair at different steps; the actor's gradient is the one of the ensemble's mean."""
    learner = _pendulum_learner("sac.n_critics=5", "sac.min_qs=2", "sac.actor_q=mean")
    assert len(learner.critic.qs) == len(learner.target.qs) == 5
    pairs = []
    for _ in range(4):
        b = learner._sample(32)
        eps = torch.randn((2, 32, 1), generator=learner.gen)
        alpha = learner.log_alpha.detach().exp()
        state = learner.gen.get_state()
        c_loss, _ = learner.critic_objective(b, eps[1], alpha)
        ref = torch.Generator()
        ref.set_state(state)
        with torch.no_grad():
            next_pi, next_logp = learner.policy.sample(b["next_obs"], eps[1])
        pair = torch.randperm(5, generator=ref)[:2].tolist()
        next_q = torch.stack([learner.target.qs[i](torch.cat([b["next_obs"], next_pi], 1)).squeeze(-1) for i in pair])
        y = b["rewards"] + learner.cfg.algorithm.gamma * (~b["terminated"]).float() * (
            next_q.min(0).values - alpha * next_logp)
        q = torch.stack([net(torch.cat([b["obs"], b["actions"]], 1)).squeeze(-1) for net in learner.critic.qs])
        assert c_loss.item() == pytest.approx(0.5 * sum(((qi - y) ** 2).mean().item() for qi in q), rel=1e-5)
        pairs.append(tuple(sorted(pair)))
    assert len(set(pairs)) > 1
    pi, logp = learner.policy.sample(b["obs"], eps[0])
    loss, _ = learner.actor_objective(b, pi, logp, alpha)
    qs = learner.critic(b["obs"], pi)
    assert loss.item() == pytest.approx((alpha * logp - qs.mean(0)).mean().item(), rel=1e-5)
    assert loss.item() != pytest.approx((alpha * logp - qs.min(0).values).mean().item(), rel=1e-3)


@pytest.mark.parametrize("runs_on", [False, True])
def test_the_learners_demonstrations_end_terminated_only_where_the_env_ends_at_success(runs_on):
    """env.kwargs.ignore_terminations reaches the demonstrations' buffer: an env that runs on past success bootstraps
    from the expert's last step, as from its own steps."""
    over = ["algorithm.name=sac", f"sac.demos={FIXTURE}", "sac.demo_episodes=3", "sac.buffer_size=100",
            "policy.hidden=[8]", *(["env.kwargs.ignore_terminations=true"] if runs_on else [])]
    cfg = C.load(EmbodiedConfig, "ppo_pickcube", over)
    learner = SACLearnerWorker(cfg, spaces.Box(-np.inf, np.inf, (42,), np.float32), spaces.Box(-1, 1, (4,), np.float32))
    ends = int(learner.demos.data["terminated"][:len(learner.demos)].sum())
    assert ends == (0 if runs_on else 3)
