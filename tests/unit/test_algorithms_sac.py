"""SAC's math against hand-written references: element-by-element loops, torch.distributions, hand-worked values."""

import math

import pytest
import torch
from torch.distributions import Normal

from m2flow.algorithms.sac import (actor_loss, critic_loss, polyak_update, soft_td_target, squashed_gaussian_logprob,
                                   temperature_loss)


def test_squashed_logprob_is_the_gaussians_minus_the_log_jacobian_of_tanh():
    torch.manual_seed(0)
    mean, log_std = torch.randn(5, 3), torch.randn(5, 3) * 0.5
    u = mean + log_std.exp() * torch.randn(5, 3)
    ours = squashed_gaussian_logprob(u, mean, log_std)
    for b in range(5):
        ref = 0.0
        for a in range(3):
            ref += Normal(mean[b, a], log_std[b, a].exp()).log_prob(u[b, a]).item()
            ref -= math.log(1 - math.tanh(u[b, a].item()) ** 2)
        assert ours[b].item() == pytest.approx(ref, rel=1e-5, abs=1e-5)


def test_squashed_logprob_stays_finite_where_tanh_saturates():
    u = torch.tensor([[30.0, -30.0]])
    logp = squashed_gaussian_logprob(u, torch.zeros(1, 2), torch.zeros(1, 2))
    assert torch.isfinite(logp).all()
    # log(1 - tanh(u)^2) -> 2 log 2 - 2|u| for large |u|
    gaussian = Normal(0.0, 1.0).log_prob(u).sum()
    assert logp.item() == pytest.approx(gaussian.item() - 2 * (2 * math.log(2) - 2 * 30.0), rel=1e-6)


def test_squashed_logprob_with_eps_is_sb3s_and_differs_from_the_exact_one_where_actions_saturate():
    """eps 1e-6: SB3's own SquashedDiagGaussianDistribution.log_prob, from moderate to saturated u; there the exact
    log-determinant keeps falling (2 log 2 - 2|u|) while SB3's stops near log(1e-6)."""
    from stable_baselines3.common.distributions import SquashedDiagGaussianDistribution

    torch.manual_seed(0)
    mean, log_std = torch.randn(6, 3) * torch.tensor([1.0, 3.0, 6.0]), torch.randn(6, 3) * 0.5
    u = mean + log_std.exp() * torch.randn(6, 3)
    sb3 = SquashedDiagGaussianDistribution(3).proba_distribution(mean, log_std)
    ref = sb3.log_prob(torch.tanh(u), gaussian_actions=u)
    assert sb3.epsilon == 1e-6
    assert squashed_gaussian_logprob(u, mean, log_std, 1e-6).tolist() == pytest.approx(ref.tolist(), rel=1e-5)
    saturated = u.abs().amax(1) > 8
    gap = squashed_gaussian_logprob(u, mean, log_std) - squashed_gaussian_logprob(u, mean, log_std, 1e-6)
    assert saturated.any() and (gap[saturated] > 1.0).all() and gap[u.abs().amax(1) < 2].abs().max() < 1e-4


def test_soft_td_target_bootstraps_through_truncation_but_not_termination():
    r = torch.tensor([1.0, 1.0, 1.0])
    terminated = torch.tensor([False, True, False])
    q1, q2 = torch.tensor([10.0, 10.0, 4.0]), torch.tensor([8.0, 12.0, 6.0])
    logp = torch.tensor([-1.0, -1.0, 2.0])
    y = soft_td_target(r, terminated, torch.stack([q1, q2]), logp, alpha=0.5, gamma=0.9)
    # min(Q') - alpha logp: 8.5, (terminated), 4 - 1 = 3
    assert y.tolist() == pytest.approx([1 + 0.9 * 8.5, 1.0, 1 + 0.9 * 3.0])
    assert not y.requires_grad


def test_critic_loss_is_half_the_sum_of_both_mses():
    q1, q2, y = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0]), torch.tensor([1.0, 1.0])
    # MSE(q1) = (0 + 1) / 2, MSE(q2) = (1 + 9) / 2
    assert critic_loss(torch.stack([q1, q2]), y).item() == pytest.approx(0.5 * (0.5 + 5.0))


def test_actor_loss_uses_the_smaller_critic_and_the_temperature():
    logp, q1, q2 = torch.tensor([-2.0, 1.0]), torch.tensor([3.0, 0.0]), torch.tensor([5.0, -1.0])
    assert actor_loss(logp, torch.stack([q1, q2]), 0.1).item() == pytest.approx(((0.1 * -2 - 3) + (0.1 * 1 + 1)) / 2)
    # REDQ / RLPD: the ensemble's mean instead
    mean = ((0.1 * -2 - 4) + (0.1 * 1 + 0.5)) / 2
    assert actor_loss(logp, torch.stack([q1, q2]), 0.1, "mean").item() == pytest.approx(mean)


def test_an_ensembles_target_takes_the_min_over_the_critics_given_and_its_loss_sums_theirs():
    r, terminated, logp = torch.tensor([0.0, 1.0]), torch.tensor([False, False]), torch.tensor([0.0, 0.0])
    qs = torch.tensor([[3.0, 1.0], [2.0, 5.0], [4.0, 0.5]])
    assert soft_td_target(r, terminated, qs, logp, alpha=1.0, gamma=0.5).tolist() == pytest.approx([1.0, 1.25])
    y = torch.tensor([3.0, 1.0])  # per-critic MSE: 0, (1 + 16) / 2, (1 + 0.25) / 2
    assert critic_loss(qs, y).item() == pytest.approx(0.5 * (0 + 8.5 + 0.625))


def test_temperature_rises_while_entropy_is_below_target():
    log_alpha = torch.zeros((), requires_grad=True)
    target_entropy = -2.0
    # logp = 5: entropy ~ -5 < -2, so d loss / d log_alpha = -(5 - 2) < 0 and gradient descent raises alpha
    temperature_loss(log_alpha, torch.tensor([5.0, 5.0]), target_entropy).backward()
    assert log_alpha.grad.item() == pytest.approx(-3.0)
    log_alpha.grad = None
    temperature_loss(log_alpha, torch.tensor([-1.0]), target_entropy).backward()  # entropy 1 > -2: alpha falls
    assert log_alpha.grad.item() == pytest.approx(3.0)


def test_polyak_update_moves_targets_tau_of_the_way():
    target, source = [torch.zeros(3), torch.ones(2)], [torch.ones(3) * 4, torch.zeros(2)]
    polyak_update(target, source, tau=0.25)
    assert target[0].tolist() == [1.0, 1.0, 1.0] and target[1].tolist() == [0.75, 0.75]
