"""SAC's hand-written gradients (m2flow.algorithms.sac_grad) against autograd's on the same networks and losses:
critics with and without RLPD's LayerNorm, the actor's loss through them, with and without the BC term."""

import numpy as np
import pytest
import torch
from gymnasium import spaces

from m2flow.algorithms import actor_loss, critic_loss
from m2flow.algorithms.sac_grad import (bc_grad, critics_action_grad, critics_loss_grads, mlp_layers, squashed_grads,
                                        squashed_sample)
from m2flow.embodied.policies import Critics
from m2flow.embodied.policies import SquashedGaussianActor

OBS, ACT, ROWS = 5, 3, 32


def _critic_nets(critics):
    return [(mlp_layers(q[0]), (q[1].weight, q[1].bias)) for q in critics.qs]


def _empty_like(nets):
    return [([tuple(map(torch.empty_like, layer)) for layer in hidden], tuple(map(torch.empty_like, head)))
            for hidden, head in nets]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _perturb_norms(critics):
    """LayerNorms off their (1, 0) init, so that a gain or shift mixed up in the gradient shows."""
    with torch.no_grad():
        for m in critics.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)


@pytest.mark.parametrize("n, layernorm", [(2, False), (5, False), (2, True), (10, True)])
def test_critics_loss_gradient_equals_autograds(n, layernorm):
    torch.manual_seed(0)
    critics = Critics(OBS, ACT, (16, 8), layernorm=layernorm, n=n)
    _perturb_norms(critics)
    obs, act, y = torch.randn(ROWS, OBS), torch.rand(ROWS, ACT) * 2 - 1, torch.randn(ROWS)
    ref = critic_loss(critics(obs, act), y)
    ref.backward()
    grads = _empty_like(_critic_nets(critics))
    with torch.no_grad():
        loss, q = critics_loss_grads(_critic_nets(critics), torch.cat([obs, act], 1), y, grads)
    _close(loss, ref.detach())
    _close(q, critics(obs, act).detach())
    checked = 0
    for (hidden, head), (g_hidden, g_head) in zip(_critic_nets(critics), grads):
        for layer, g_layer in zip([*hidden, head], [*g_hidden, g_head]):
            for p, g in zip(layer, g_layer, strict=True):
                _close(g, p.grad)
                checked += 1
    assert checked == len(list(critics.parameters()))  # every weight, the LayerNorms' too


@pytest.mark.parametrize("reduce, layernorm, bc, logp_eps", [("min", False, 0.0, 0.0), ("mean", False, 0.0, 0.0),
                                                              ("mean", True, 0.0, 0.0), ("min", False, 2.5, 0.0),
                                                              ("min", False, 0.0, 1e-6)])
def test_actor_loss_gradient_through_the_critics_equals_autograds(reduce, layernorm, bc, logp_eps):
    """(logp_eps 1e-6, SB3's log-density: the std of e^2 on one action dim saturates some of its actions, where
    the eps changes the gradient)"""
    torch.manual_seed(1)
    box = spaces.Box(-2.0, np.array([2.0, 1.0, 3.0], np.float32))
    actor = SquashedGaussianActor(OBS, box, (16, 8), logp_eps=logp_eps)
    critics = Critics(OBS, ACT, (16, 8), layernorm=layernorm, n=3)
    _perturb_norms(critics)
    with torch.no_grad():  # some log stds past the clamp's bounds, where no gradient passes
        actor.log_std_head.bias.copy_(torch.tensor([-25.0, 0.0, 6.0]))
    obs, eps, alpha = torch.randn(ROWS, OBS), torch.randn(ROWS, ACT), 0.3
    demo, k = torch.rand(ROWS, ACT) * 2 - 1, ROWS // 4  # the BC term's rows: the first k
    critics.requires_grad_(False)
    pi, logp = actor.sample(obs, eps)
    ref = actor_loss(logp, critics(obs, pi), alpha, reduce)
    ref_bc = (torch.tanh(actor.dist(obs[:k])[0]) - demo[:k]).pow(2).sum(-1).mean()  # as SACLearnerWorker's
    (ref + bc * ref_bc).backward()
    bounds = (actor.LOG_STD_MIN, actor.LOG_STD_MAX)
    trunk, mu, log_std = mlp_layers(actor.trunk), (actor.mu.weight, actor.mu.bias), (actor.log_std_head.weight,
                                                                                 actor.log_std_head.bias)
    grads = ([(torch.empty_like(w), torch.empty_like(b)) for w, b in trunk], tuple(map(torch.empty_like, mu)),
             tuple(map(torch.empty_like, log_std)))
    with torch.no_grad():
        action, logp2, fwd = squashed_sample(trunk, mu, log_std, obs, eps, bounds, logp_eps)
        score, d_action = critics_action_grad(_critic_nets(critics), obs, action, reduce)
        loss = (alpha * logp2 - score).mean()
        bc_term, d_mean = bc_grad(fwd.mean, demo[:k], bc) if bc else (None, None)
        squashed_grads(trunk, mu, log_std, obs, fwd, d_action, alpha / ROWS, bounds, grads, d_mean)
    _close(action, pi.detach())
    _close(logp2, logp.detach())
    _close(loss, ref.detach())
    if bc:
        _close(bc_term, ref_bc.detach())
        assert d_mean[k:].abs().sum() == 0 and d_mean[:k].abs().sum() > 0
    assert grads[2][1][0] == 0 and grads[2][1][2] == 0 and grads[2][1][1] != 0  # clamped units get no gradient
    for (w, b), (gw, gb) in zip([*trunk, mu, log_std], [*grads[0], grads[1], grads[2]]):
        _close(gw, w.grad)
        _close(gb, b.grad)
