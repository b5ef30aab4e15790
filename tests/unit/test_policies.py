"""Actor-critic policies: shapes, Gaussian/Categorical logprobs vs torch.distributions, deterministic actions, init,
chunks and the CNN for 64x64 pixel obs."""

import math

import numpy as np
import pytest
import torch
from gymnasium import spaces
from torch.distributions import Categorical, Normal

from m2flow.embodied.policies import CNNActorCritic, MLPActorCritic, build_policy

BOX = spaces.Box(-1.0, 1.0, (6,), np.float32)
DISCRETE = spaces.Discrete(3)


def test_mlp_shapes_box_and_discrete():
    torch.manual_seed(0)
    obs = torch.randn(5, 17)
    pol = MLPActorCritic(17, BOX)
    action, logprob, value = pol.act(obs)
    assert action.shape == (5, 6) and logprob.shape == (5,) and value.shape == (5,)
    lp, ent, v = pol.evaluate(obs, action)
    assert lp.shape == ent.shape == v.shape == (5,)
    torch.testing.assert_close(lp, logprob)
    torch.testing.assert_close(v, value)
    torch.testing.assert_close(pol.value(obs), value)

    cat = MLPActorCritic(4, DISCRETE)
    action, logprob, value = cat.act(torch.randn(5, 4))
    assert action.shape == (5,) and action.dtype == torch.int64 and logprob.shape == value.shape == (5,)
    assert ((action >= 0) & (action < 3)).all()
    with pytest.raises(ValueError, match="expected obs_dim=4"):
        cat.act(torch.randn(5, 3))


def test_gaussian_logprob_and_entropy_match_torch_distributions():
    torch.manual_seed(1)
    pol = MLPActorCritic(17, BOX, hidden=(32, 32))
    with torch.no_grad():
        pol.log_std.copy_(torch.linspace(-1.0, 0.5, 6))
    obs, actions = torch.randn(8, 17), torch.randn(8, 6) * 2  # actions outside [-1, 1]: logprob of the raw sample
    mean = pol.actor_head(pol.actor(obs))
    ref = Normal(mean, pol.log_std.exp())
    lp, ent, _ = pol.evaluate(obs, actions)
    torch.testing.assert_close(lp, ref.log_prob(actions).sum(-1))
    torch.testing.assert_close(ent, ref.entropy().sum(-1))
    std = pol.log_std.exp()  # and the closed form
    by_hand = (-((actions - mean) ** 2) / (2 * std**2) - pol.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
    torch.testing.assert_close(lp, by_hand)


def test_categorical_logprob_matches_torch_distributions():
    torch.manual_seed(2)
    pol = MLPActorCritic(4, spaces.Discrete(5))
    obs, actions = torch.randn(7, 4), torch.randint(0, 5, (7,))
    ref = Categorical(logits=pol.actor_head(pol.actor(obs)))
    lp, ent, _ = pol.evaluate(obs, actions)
    torch.testing.assert_close(lp, ref.log_prob(actions))
    torch.testing.assert_close(ent, ref.entropy())


def test_deterministic_act_is_mean_or_argmax():
    torch.manual_seed(3)
    obs = torch.randn(4, 17)
    pol = MLPActorCritic(17, BOX)
    action, _, _ = pol.act(obs, deterministic=True)
    torch.testing.assert_close(action, pol.actor_head(pol.actor(obs)))
    torch.testing.assert_close(pol.act(obs, deterministic=True)[0], action)

    shifted = spaces.Discrete(4, start=-1)  # actions -1..2
    cat = MLPActorCritic(17, shifted)
    with torch.no_grad():
        cat.actor_head.weight.mul_(100)  # spread the logits so sampling and argmax are distinguishable
    action, logprob, _ = cat.act(obs, deterministic=True)
    torch.testing.assert_close(action, cat.actor_head(cat.actor(obs)).argmax(-1) - 1)
    torch.testing.assert_close(cat.evaluate(obs, action)[0], logprob)


def test_init_is_orthogonal_with_separate_actor_and_critic():
    pol = MLPActorCritic(17, BOX, hidden=(64, 64))
    w = pol.actor[2].weight  # 64x64 hidden layer: orthogonal with gain sqrt(2)
    torch.testing.assert_close(w @ w.T, 2 * torch.eye(64), atol=1e-4, rtol=0)
    assert pol.actor_head.weight.abs().max() < 0.05 and (pol.log_std == 0).all()
    assert pol.actor[0].weight.data_ptr() != pol.critic[0].weight.data_ptr()
    assert isinstance(pol.actor[1], torch.nn.Tanh)
    assert isinstance(MLPActorCritic(3, BOX, activation="relu").critic[1], torch.nn.ReLU)
    lp, ent, v = pol.evaluate(torch.randn(3, 17), torch.randn(3, 6))
    (lp.sum() + v.sum()).backward()
    assert all(p.grad is not None for p in (pol.log_std, pol.actor[0].weight, pol.critic[0].weight))


def test_action_chunks_sum_logprob_over_the_chunk():
    torch.manual_seed(4)
    pol = MLPActorCritic(17, BOX, chunk=3)
    obs = torch.randn(5, 17)
    action, logprob, value = pol.act(obs)
    assert action.shape == (5, 3, 6) and logprob.shape == value.shape == (5,)
    mean = pol.actor_head(pol.actor(obs)).view(5, 3, 6)
    ref = Normal(mean, pol.log_std.exp().view(3, 6)).log_prob(action).sum((1, 2))
    torch.testing.assert_close(logprob, ref)
    cat = MLPActorCritic(4, DISCRETE, chunk=2)
    obs = torch.randn(5, 4)
    action, logprob, _ = cat.act(obs)
    assert action.shape == (5, 2)
    ref = Categorical(logits=cat.actor_head(cat.actor(obs)).view(5, 2, 3)).log_prob(action).sum(1)
    torch.testing.assert_close(logprob, ref)
    torch.testing.assert_close(cat.evaluate(obs, action)[0], logprob)


@pytest.mark.parametrize("space,chunk", [(BOX, 1), (BOX, 3), (DISCRETE, 1), (DISCRETE, 2)])
def test_evaluate_in_closed_form_equals_torch_distributions_with_gradients(space, chunk):
    """evaluate() computes log_prob and entropy without a distribution object: values and gradients equal those of
    the distribution `_dist` builds (summed over a chunk), for Gaussian and categorical heads."""
    torch.manual_seed(6)
    pol = MLPActorCritic(4, space, hidden=(16,), chunk=chunk)
    if isinstance(space, spaces.Box):
        with torch.no_grad():
            pol.log_std.copy_(torch.linspace(-1.0, 0.5, pol.log_std.numel()))
    obs = torch.randn(9, 4)
    actions = pol.act(obs)[0]

    def grads(lp, ent):
        pol.zero_grad()
        (lp * torch.arange(9.0)).sum().add(ent.sum()).backward()
        return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in pol.parameters()]

    lp, ent, _ = pol.evaluate(obs, actions)
    mine = grads(lp, ent)
    dist = pol._dist(pol.actor(obs))
    ref_lp, ref_ent = pol._sum(dist.log_prob(actions)), pol._sum(dist.entropy())  # over the chunk and action dims
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    for a, b in zip(mine, grads(ref_lp, ref_ent)):
        torch.testing.assert_close(a, b)


def test_cnn_policy_on_64x64_uint8_frames():
    torch.manual_seed(5)
    pixel_space = spaces.Box(0, 255, (3, 64, 64), np.uint8)
    pol = build_policy(pixel_space, BOX, kind="cnn")
    assert isinstance(pol, CNNActorCritic)
    frames = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    action, logprob, value = pol.act(frames)
    assert action.shape == (2, 6) and logprob.shape == value.shape == (2,)
    lp, ent, v = pol.evaluate(frames, action)
    torch.testing.assert_close(lp, logprob)
    torch.testing.assert_close(pol.act(frames, deterministic=True)[0], pol.actor_head(pol.features(frames)[0]))
    with pytest.raises(ValueError, match=r"expected \[B, \*\(3, 64, 64\)\]"):
        pol.act(torch.zeros(2, 64, 64, 3, dtype=torch.uint8))
    assert build_policy(pixel_space, DISCRETE, kind="cnn", features_dim=32).act(frames)[0].shape == (2,)
    n_tensors = len(pol.state_dict())  # no parameter registered twice (safetensors refuses shared tensors)
    assert n_tensors == len(list(pol.parameters())) == 3 * 2 + 2 + 2 + 2 + 1


def test_build_policy_checks_kind_and_obs_space():
    state_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
    assert isinstance(build_policy(state_space, DISCRETE, hidden=(16,)), MLPActorCritic)
    with pytest.raises(ValueError, match="needs uint8"):
        build_policy(state_space, DISCRETE, kind="cnn")
    with pytest.raises(ValueError, match="unknown policy kind 'rnn'"):
        build_policy(state_space, DISCRETE, kind="rnn")
    with pytest.raises(ValueError, match="not supported"):
        build_policy(state_space, spaces.MultiBinary(3))
