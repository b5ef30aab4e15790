"""SAC's gradients written out by hand for ReLU MLPs (the critics' loss into the critics' weights; the actor's loss,
with its behaviour-cloning term, through the critics' action input into the actor's weights), as `sac.grad=manual`
computes them instead of autograd. The same math as m2flow.algorithms.sac's losses (tests/unit/test_sac_grad.py
checks every gradient against autograd's). On a 256x256 SAC step, autograd's graph bookkeeping and the fresh tensors
it allocates for every intermediate and gradient take 13-18% of the step (`benchmarks/sac_vs_sb3.py --update-only`).
The matmuls, which both paths pay alike, take most of the rest.

A network is plain tensors: `hidden`, a list of layers, each a (weight [out, in], bias [out]) pair, or a (weight,
bias, norm weight [out], norm bias [out]) 4-tuple for a layer with a LayerNorm (eps LN_EPS, torch's default) between
its linear map and its ReLU (RLPD's critics); then its head(s). Gradients are written into caller-given tensors (a
parameter's `.grad`), shaped as the layers, not accumulated. Pure tensor functions: run them under torch.no_grad().
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from .sac import squashed_gaussian_logprob

Layer = tuple[torch.Tensor, ...]  # (weight [out, in], bias [out]) or (weight, bias, norm weight, norm bias)
LN_EPS = 1e-5  # torch.nn.LayerNorm's default, which the critics' LayerNorms keep


class Hidden(NamedTuple):
    """What a hidden stack's backward needs of its forward: every layer's ReLU output (the last is the features the
    heads read), and for a layer with a LayerNorm the norm's input and row statistics (None for a plain layer)."""
    hs: list[torch.Tensor]
    norms: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]


class Squashed(NamedTuple):
    """What the actor's backward needs of its forward: the trunk's activations, the mean, the raw log std (before
    the clamp), the std, the noise, the action tanh(u) and the log-density's eps (`squashed_gaussian_logprob`)."""
    trunk: Hidden
    mean: torch.Tensor
    log_std_raw: torch.Tensor
    std: torch.Tensor
    eps: torch.Tensor
    action: torch.Tensor
    logp_eps: float = 0.0


def mlp_layers(seq: torch.nn.Module) -> list[Layer]:
    """A module's layers as these functions read them: each Linear's (weight, bias), with the LayerNorm after it
    (eps LN_EPS, affine) appended as (weight, bias, norm weight, norm bias)."""
    out: list[Layer] = []
    for m in seq.modules():
        if isinstance(m, torch.nn.Linear):
            out.append((m.weight, m.bias))
        elif isinstance(m, torch.nn.LayerNorm):
            if m.eps != LN_EPS or not m.elementwise_affine or not out or len(out[-1]) != 2:
                raise ValueError(f"sac.grad=manual: a LayerNorm with eps {LN_EPS}, affine, after a Linear, expected; "
                                 f"got {m}")
            out[-1] = (*out[-1], m.weight, m.bias)
    return out


def relu_forward(hidden: Sequence[Layer], x: torch.Tensor) -> Hidden:
    """x [B, in] -> every hidden layer's ReLU output [B, width], and what a LayerNorm's backward needs."""
    hs, norms = [], []
    for layer in hidden:
        z = torch.addmm(layer[1], x, layer[0].t())
        if len(layer) == 4:
            x, mean, rstd = torch.native_layer_norm(z, [z.shape[1]], layer[2], layer[3], LN_EPS)
            norms.append((z, mean, rstd))
        else:
            x = z
            norms.append(None)
        x = x.relu_()
        hs.append(x)
    return Hidden(hs, norms)


def relu_backward(hidden: Sequence[Layer], x: torch.Tensor, fwd: Hidden, d_out: torch.Tensor,
                  grads: Sequence[Layer] | None = None, input_cols: slice | None = None) -> torch.Tensor | None:
    """Back through `relu_forward(hidden, x)` (-> fwd) from d_out (the loss's gradient on its last output, before
    that ReLU's mask): the layers' gradients into `grads` (tensors shaped as the layers; None: not wanted), and ->
    the gradient on x's columns `input_cols` (None: not wanted)."""
    hs, want = fwd.hs, grads is not None
    d = torch.ops.aten.threshold_backward(d_out, hs[-1], 0.0)
    for j in range(len(hidden) - 1, -1, -1):
        layer = hidden[j]
        if fwd.norms[j] is not None:  # back through the LayerNorm to its input z
            z, mean, rstd = fwd.norms[j]
            d, d_gain, d_shift = torch.ops.aten.native_layer_norm_backward(
                d, z, [z.shape[1]], mean, rstd, layer[2], layer[3], [True, want, want])
            if want:
                grads[j][2].copy_(d_gain)
                grads[j][3].copy_(d_shift)
        below = hs[j - 1] if j else x
        if want:
            torch.mm(d.t(), below, out=grads[j][0])
            torch.sum(d, 0, out=grads[j][1])
        if j:
            d = torch.ops.aten.threshold_backward(torch.mm(d, layer[0]), hs[j - 1], 0.0)
        elif input_cols is not None:
            return torch.mm(d, layer[0][:, input_cols])
    return None


def head_grads(head: Layer, grads: Layer, h: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """A linear head's weight and bias gradients from its output's gradient d [B, out] and its input h, into
    `grads` -> the gradient on h."""
    torch.mm(d.t(), h, out=grads[0])
    torch.sum(d, 0, out=grads[1])
    return torch.mm(d, head[0])


def critic_forward(hidden: Sequence[Layer], head: Layer, x: torch.Tensor) -> tuple[torch.Tensor, Hidden]:
    """One critic on x = [obs, action] -> (Q [B], its hidden stack's forward)."""
    fwd = relu_forward(hidden, x)
    return torch.addmm(head[1], fwd.hs[-1], head[0].t()).squeeze(1), fwd


def critics_forward(critics: Sequence[tuple[Sequence[Layer], Layer]],
                    x: torch.Tensor) -> list[tuple[torch.Tensor, Hidden]]:
    """Every critic's `critic_forward` on x -> a (Q [B], hidden stack's forward) pair a critic."""
    return [critic_forward(hidden, head, x) for hidden, head in critics]


def critics_loss_grads(critics: Sequence[tuple[Sequence[Layer], Layer]], x: torch.Tensor, target: torch.Tensor,
                       grads: Sequence[tuple[Sequence[Layer], Layer]],
                       runs: Sequence[tuple[torch.Tensor, Hidden]] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """m2flow.algorithms.critic_loss of the critics on x against the soft TD target [B], and its gradient into every
    critic's (hidden, head) `grads` -> (the loss, Q [n, B]). `runs`: `critics_forward(critics, x)` when it was
    already taken (before the target was known)."""
    n_rows, qs, loss = len(target), [], torch.zeros(())
    runs = critics_forward(critics, x) if runs is None else runs
    for (hidden, head), (g_hidden, g_head), (q, fwd) in zip(critics, grads, runs):
        err = q - target
        loss = loss + 0.5 * err.pow(2).mean()
        d_h = head_grads(head, g_head, fwd.hs[-1], (err / n_rows).unsqueeze(1))
        relu_backward(hidden, x, fwd, d_h, g_hidden)
        qs.append(q)
    return loss, torch.stack(qs)


def critics_action_grad(critics: Sequence[tuple[Sequence[Layer], Layer]], obs: torch.Tensor, action: torch.Tensor,
                        reduce: str = "min") -> tuple[torch.Tensor, torch.Tensor]:
    """The critics' score of (obs, action) as m2flow.algorithms.actor_loss reads it (their min, or mean), and
    -d mean(score) / d action: the actor's loss's gradient on its action from the critics (whose weights get none)
    -> (score [B], that gradient [B, A])."""
    x = torch.cat([obs, action], 1)
    runs = critics_forward(critics, x)
    q = torch.stack([r[0] for r in runs])
    n, n_rows = len(runs), len(obs)
    if reduce == "min":
        score, pick = q.min(0)
        weights = [(pick == i).to(q.dtype).mul_(-1.0 / n_rows) for i in range(n)]
    else:
        score, weights = q.mean(0), [torch.full_like(q[0], -1.0 / (n * n_rows))] * n
    grad = torch.zeros_like(action)
    cols = slice(obs.shape[1], x.shape[1])
    for (hidden, head), (_, fwd), w in zip(critics, runs, weights):
        grad += relu_backward(hidden, x, fwd, torch.mm(w.unsqueeze(1), head[0]), input_cols=cols)
    return score, grad


def squashed_sample(hidden: Sequence[Layer], mu: Layer, log_std: Layer, obs: torch.Tensor, eps: torch.Tensor,
                    log_std_bounds: tuple[float, float], logp_eps: float = 0.0
                   ) -> tuple[torch.Tensor, torch.Tensor, Squashed]:
    """The squashed-Gaussian actor's reparameterized sample, as SquashedGaussianActor.sample computes it (its
    log-density's eps `logp_eps`) -> (tanh(u) [B, A], log pi [B], what `squashed_grads` needs)."""
    trunk = relu_forward(hidden, obs)
    mean = torch.addmm(mu[1], trunk.hs[-1], mu[0].t())
    raw = torch.addmm(log_std[1], trunk.hs[-1], log_std[0].t())
    clamped = raw.clamp(*log_std_bounds)
    std = clamped.exp()
    u = torch.addcmul(mean, std, eps)
    action = torch.tanh(u)
    return (action, squashed_gaussian_logprob(u, mean, clamped, logp_eps),
            Squashed(trunk, mean, raw, std, eps, action, logp_eps))


def squashed_grads(hidden: Sequence[Layer], mu: Layer, log_std: Layer, obs: torch.Tensor, fwd: Squashed,
                   d_action: torch.Tensor, d_logp: float, log_std_bounds: tuple[float, float],
                   grads: tuple[Sequence[Layer], Layer, Layer], d_mean: torch.Tensor | None = None) -> None:
    """The gradient of a loss into the actor's weights (`grads`: (hidden, mu, log std) as the layers), from its
    gradient on the action d_action [B, A] and on log pi (the same d_logp for every row), and on the mean beside
    its path through the action (d_mean [B, A], a behaviour-cloning term's: `bc_grad`). With u = mean + std eps:
    d log pi / d u = 2 tanh(u) (the tanh's log-determinant; the Gaussian's term is a function of eps alone; with the
    log-density's eps e, 2 tanh(u) (1 - tanh(u)^2) / (1 - tanh(u)^2 + e)), and
    d log pi / d log std = -1 beside its path through u; the clamp passes gradient inside its bounds only."""
    a = fwd.action
    slope = 1.0 - a * a
    d_logdet = a if not fwd.logp_eps else a * slope / (slope + fwd.logp_eps)
    d_u = d_action * slope + (2.0 * d_logp) * d_logdet
    d_raw = (d_u * fwd.std * fwd.eps - d_logp) * ((fwd.log_std_raw >= log_std_bounds[0])
                                                   & (fwd.log_std_raw <= log_std_bounds[1]))
    g_hidden, g_mu, g_log_std = grads
    features = fwd.trunk.hs[-1]
    d_h = head_grads(mu, g_mu, features, d_u if d_mean is None else d_u + d_mean)
    d_h += head_grads(log_std, g_log_std, features, d_raw)
    relu_backward(hidden, obs, fwd.trunk, d_h, g_hidden)


def bc_grad(mean: torch.Tensor, demo_actions: torch.Tensor, coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The behaviour-cloning term of the actor's loss: the squared error of the deterministic action tanh(mean) to
    the demonstrated one, summed over the action's numbers and averaged over the k = len(demo_actions) rows it
    covers (the minibatch's first) -> (the term, coef x its gradient on mean [B, A], zero past the first k rows)."""
    k = len(demo_actions)
    t = torch.tanh(mean[:k])
    err = t - demo_actions
    d_mean = torch.zeros_like(mean)
    d_mean[:k] = err * (1.0 - t * t) * (2.0 * coef / k)
    return err.pow(2).sum(-1).mean(), d_mean


def actor_loss_grads(critics: Sequence[tuple[Sequence[Layer], Layer]], actor: tuple, grads: tuple, obs: torch.Tensor,
                     pi: torch.Tensor, logp: torch.Tensor, fwd: Squashed, alpha: torch.Tensor,
                     demo_actions: torch.Tensor, coef: float, reduce: str, log_std_bounds: tuple[float, float],
                     read: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SAC's actor loss, mean(alpha log pi - score) with the critics' score of the sampled actions pi (their min or
    mean: `reduce`), plus with `coef` the behaviour-cloning term on the first len(demo_actions) rows, and its
    gradient into the actor's (hidden, mu, log std) `grads` -> (the loss, the BC term). `read` is called with
    log pi once the critics' weights are no longer read (another thread or process may step them then)."""
    score, d_action = critics_action_grad(critics, obs, pi, reduce)
    if read is not None:
        read(logp)
    bc, d_mean = torch.zeros(()), None
    if coef:
        bc, d_mean = bc_grad(fwd.mean, demo_actions, coef)
    squashed_grads(*actor, obs, fwd, d_action, float(alpha) / len(obs), log_std_bounds, grads, d_mean)
    return (alpha * logp - score).mean(), bc
