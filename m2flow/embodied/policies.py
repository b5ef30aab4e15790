"""Actor-critic policies for embodied RL: an MLP for state obs and a Nature-CNN for 64x64 pixel obs, with a Gaussian
(Box) or Categorical (Discrete) action head. Pure torch modules: they never step an env and hold no loss.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from gymnasium import spaces
from torch import nn
from torch.distributions import Categorical, Normal

from m2flow.algorithms.sac import squashed_gaussian_logprob

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "elu": nn.ELU}


def gaussian_logprob(actions: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """Per-dimension log N(actions; mean, exp(log_std)^2), the arithmetic of the trainer and the sampler alike (so
    the first epoch's importance ratio is exactly 1)."""
    z = (actions - mean) * torch.exp(-log_std)
    return -0.5 * z.pow(2) - log_std - _HALF_LOG_2PI


def categorical_logprob(log_p: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_p [..., n] (log_softmax of the logits), index [...] -> the chosen entries' log-probabilities [...]."""
    return log_p.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def gumbel_noise(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise from uniforms u (clamped off 0 and 1): argmax(log p + gumbel_noise(u)) is an exact sample of p."""
    return -torch.log(-torch.log(u.clamp(1e-12, 1 - 1e-7)))


def _linear(in_features: int, out_features: int, gain: float) -> nn.Linear:
    layer = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    """Action head, value head and the act/evaluate/value interface; subclasses provide `features(obs)`.

    Action shapes: Box [B, *shape], Discrete [B]; with chunk=k > 1 a policy call gives k actions, [B, k, *shape] /
    [B, k], and logprob/entropy are summed over the chunk. Box actions are the raw Gaussian sample (unclipped: the env
    group clips at the env step), so `logprob` is that of the sample.
    """

    def __init__(self, action_space: spaces.Space, actor_dim: int, critic_dim: int, chunk: int = 1,
                 log_std_init: float = 0.0):
        super().__init__()
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.action_space, self.chunk = action_space, chunk
        if isinstance(action_space, spaces.Box):
            self.act_shape = tuple(action_space.shape)
            out = chunk * math.prod(self.act_shape)
            self.log_std = nn.Parameter(torch.full((out,), float(log_std_init)))  # state-independent
        elif isinstance(action_space, spaces.Discrete):
            self.act_shape = ()
            out = chunk * int(action_space.n)
        else:
            raise ValueError(f"action space {action_space} is not supported (Box or Discrete)")
        self.actor_head = _linear(actor_dim, out, gain=0.01)
        self.critic_head = _linear(critic_dim, 1, gain=1.0)

    def features(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """obs [B, *obs] -> (actor features [B, actor_dim], critic features [B, critic_dim])."""
        raise NotImplementedError

    def _dist(self, actor_feat: torch.Tensor):
        """A distribution over actions of shape [B, (k,) *act_shape] (Discrete: over indices from 0)."""
        b, out = actor_feat.shape[0], self.actor_head(actor_feat)
        lead = (b, self.chunk) if self.chunk > 1 else (b,)
        if isinstance(self.action_space, spaces.Box):
            return Normal(out.view(*lead, *self.act_shape), self.log_std.exp().view(*lead[1:], *self.act_shape))
        return Categorical(logits=out.view(*lead, int(self.action_space.n)))

    @staticmethod
    def _sum(x: torch.Tensor) -> torch.Tensor:
        """[B, ...] per-dimension terms -> [B]."""
        return x.flatten(1).sum(-1) if x.ndim > 1 else x

    def _to_index(self, actions: torch.Tensor) -> torch.Tensor:
        return actions.long() - int(self.action_space.start)

    def act(self, obs: torch.Tensor, deterministic: bool = False):
        """obs [B, *obs] -> (action [B, (k,) *act], logprob [B], value [B]). Deterministic: Gaussian mean / argmax."""
        actor_feat, critic_feat = self.features(obs)
        dist = self._dist(actor_feat)
        if isinstance(dist, Normal):
            action = dist.mean if deterministic else dist.sample()
            logprob = self._sum(dist.log_prob(action))
        else:
            index = dist.probs.argmax(-1) if deterministic else dist.sample()
            logprob = self._sum(dist.log_prob(index))
            action = index + int(self.action_space.start)
        return action, logprob, self.critic_head(critic_feat).squeeze(-1)

    def head(self, actor_feat: torch.Tensor) -> torch.Tensor:
        """actor features [B, actor_dim] -> the action head's output: Box means [B, (k,) *act], Discrete logits
        [B, (k,) n]. With `gaussian_logprob` / `categorical_logprob` it gives `_dist`'s log-probabilities in closed
        form, without building a distribution (a third of the ops: a small policy is bound by their count)."""
        b, out = actor_feat.shape[0], self.actor_head(actor_feat)
        lead = (b, self.chunk) if self.chunk > 1 else (b,)
        return out.view(*lead, *(self.act_shape if isinstance(self.action_space, spaces.Box)
                                  else (int(self.action_space.n),)))

    def log_std_of(self, mean: torch.Tensor) -> torch.Tensor:
        """The Box policy's log std, shaped to broadcast against `mean` [B, (k,) *act]."""
        return self.log_std.view(*mean.shape[1:])

    def scale_std(self, factor: float) -> None:
        """Multiply the Gaussian's std by `factor` (policy.init_std_scale: narrower exploration from a clone)."""
        if not isinstance(self.action_space, spaces.Box):
            raise ValueError(f"policy.init_std_scale needs a Gaussian (Box) policy; this one acts in "
                             f"{self.action_space}")
        with torch.no_grad():
            self.log_std += math.log(factor)

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor):
        """obs [B, *obs], actions [B, (k,) *act] -> (logprob [B], entropy [B], value [B]): `_dist`'s log_prob and
        entropy in closed form (see `head`)."""
        actor_feat, critic_feat = self.features(obs)
        out = self.head(actor_feat)
        if isinstance(self.action_space, spaces.Box):
            log_std = self.log_std_of(out)
            logprob = gaussian_logprob(actions, out, log_std)
            entropy = (log_std + 0.5 + _HALF_LOG_2PI).expand(logprob.shape)
        else:
            log_p = torch.log_softmax(out, -1)
            logprob = categorical_logprob(log_p, self._to_index(actions))
            entropy = -(log_p.exp() * log_p).sum(-1)
        return self._sum(logprob), self._sum(entropy), self.critic_head(critic_feat).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """obs [B, *obs] -> V(obs) [B]."""
        return self.critic_head(self.features(obs)[1]).squeeze(-1)

    def _device(self) -> torch.device:
        return self.critic_head.weight.device


def _mlp(in_dim: int, hidden: tuple[int, ...], activation: type[nn.Module], ortho: bool = True,
         layernorm: bool = False) -> nn.Sequential:
    """Linear (+ LayerNorm) + activation layers: orthogonal init (gain sqrt 2), or torch's default (`ortho=False`:
    SB3's off-policy networks). ReLU works in place, on the layer's own output (which no backward needs): one
    activation tensor a layer instead of two, so the next op reads memory still in cache."""
    layers, d = [], in_dim
    for h in hidden:
        layers += [_linear(d, h, gain=math.sqrt(2)) if ortho else nn.Linear(d, h),
                   *([nn.LayerNorm(h)] if layernorm else []), activation(inplace=True) if activation is nn.ReLU
                   else activation()]
        d = h
    return nn.Sequential(*layers)


def _run(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """`layers(x)` without a module call's hook checks per layer (~2 us each: a fifth of an 8-env policy step)."""
    for layer in layers:
        x = layer.forward(x)
    return x


class MLPActorCritic(ActorCritic):
    """Separate actor and critic MLPs (orthogonal init, gain sqrt 2; heads 0.01 / 1) on flattened float obs."""

    def __init__(self, obs_dim: int, action_space: spaces.Space, hidden: tuple[int, ...] = (64, 64),
                 activation: str | type[nn.Module] = "tanh", chunk: int = 1, log_std_init: float = 0.0):
        act = ACTIVATIONS[activation] if isinstance(activation, str) else activation
        width = hidden[-1] if hidden else obs_dim
        super().__init__(action_space, width, width, chunk, log_std_init)
        self.obs_dim = obs_dim
        self.actor = _mlp(obs_dim, tuple(hidden), act)
        self.critic = _mlp(obs_dim, tuple(hidden), act)

    def features(self, obs):
        x = torch.as_tensor(obs, device=self._device()).float().flatten(1)
        if x.shape[1] != self.obs_dim:
            raise ValueError(f"MLPActorCritic: obs of shape {tuple(obs.shape)} flatten to {x.shape[1]} features, "
                             f"expected obs_dim={self.obs_dim}")
        return _run(self.actor, x), _run(self.critic, x)


class CNNActorCritic(ActorCritic):
    """Nature-CNN encoder (conv 8/4, 4/2, 3/1 -> 512) on uint8 [B, C, H, W] frames scaled to [0, 1], shared by the
    actor and critic heads (as SB3's and CleanRL's pixel PPO)."""

    def __init__(self, obs_shape: tuple[int, int, int], action_space: spaces.Space, features_dim: int = 512,
                 chunk: int = 1, log_std_init: float = 0.0):
        super().__init__(action_space, features_dim, features_dim, chunk, log_std_init)
        self.obs_shape = tuple(obs_shape)
        c = self.obs_shape[0]
        g = math.sqrt(2)
        convs = [nn.Conv2d(c, 32, 8, stride=4), nn.Conv2d(32, 64, 4, stride=2), nn.Conv2d(64, 64, 3, stride=1)]
        for conv in convs:
            nn.init.orthogonal_(conv.weight, g)
            nn.init.zeros_(conv.bias)
        conv = nn.Sequential(convs[0], nn.ReLU(), convs[1], nn.ReLU(), convs[2], nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            flat = conv(torch.zeros(1, *self.obs_shape)).shape[1]
        self.encoder = nn.Sequential(conv, _linear(flat, features_dim, gain=g), nn.ReLU())

    def features(self, obs):
        x = torch.as_tensor(obs, device=self._device())
        if tuple(x.shape[1:]) != self.obs_shape:
            raise ValueError(f"CNNActorCritic: obs of shape {tuple(x.shape)}, expected [B, *{self.obs_shape}] "
                             "(channel-first frames)")
        z = self.encoder(x.float() / 255.0)
        return z, z


class InstructActorCritic(MLPActorCritic):
    """An instruction-conditioned policy for observations [word ids (`tokens`); state] (ManiSkill's
    `InstructionObservation`): each word is embedded, the instruction's words averaged (padding left out), and the
    actor and critic MLPs read [that average; state]. With `chunk` it emits k actions per call, as a VLA's action
    chunk; the head is Gaussian (the actions are continuous end-effector deltas; discretised action tokens, as
    OpenVLA's, suit a language-model backbone, which this tiny policy is not). A bag of words and not a transformer:
    the instructions are a handful of fixed sentences, which a lookup tells apart as well."""

    def __init__(self, obs_dim: int, action_space: spaces.Space, tokens: int, vocab: int, embed_dim: int = 16,
                 **kw):
        if obs_dim <= tokens:
            raise ValueError(f"InstructActorCritic: obs of {obs_dim} numbers leave no state after {tokens} word ids")
        super().__init__(obs_dim - tokens + embed_dim, action_space, **kw)
        self.tokens, self.vocab = tokens, vocab
        self.embed = nn.Embedding(vocab, embed_dim, padding_idx=0)

    def features(self, obs):
        x = torch.as_tensor(obs, device=self._device()).float()
        ids = x[:, :self.tokens].long()
        if ids.min() < 0 or ids.max() >= self.vocab:
            raise ValueError(f"InstructActorCritic: word ids outside [0, {self.vocab}): not instruction observations")
        words = (ids != 0).float()
        text = (self.embed(ids) * words[..., None]).sum(1) / words.sum(1, keepdim=True).clamp(min=1.0)
        return super().features(torch.cat([text, x[:, self.tokens:]], dim=1))


def build_policy(obs_space: spaces.Box, action_space: spaces.Space, kind: str = "mlp", **kw) -> ActorCritic:
    """kind "mlp": MLPActorCritic on the flattened obs; "cnn": CNNActorCritic on [C, H, W] uint8 frames; "instruct":
    InstructActorCritic on ManiSkill's instruction observations."""
    if kind == "mlp":
        return MLPActorCritic(int(np.prod(obs_space.shape)), action_space, **kw)
    if kind == "instruct":
        from .envs.maniskill import INSTRUCTION_TOKENS, VOCAB

        return InstructActorCritic(int(np.prod(obs_space.shape)), action_space, tokens=INSTRUCTION_TOKENS,
                                   vocab=len(VOCAB), **kw)
    if kind == "cnn":
        if len(obs_space.shape) != 3 or obs_space.dtype != np.uint8:
            raise ValueError(f"kind='cnn' needs uint8 [C, H, W] pixel obs (pixels=True), got {obs_space}")
        return CNNActorCritic(tuple(obs_space.shape), action_space, **kw)
    raise ValueError(f"unknown policy kind {kind!r}; expected mlp | cnn | instruct")


class SquashedGaussianActor(nn.Module):
    """SAC's actor (as SB3's): an MLP trunk, then the mean and a state-dependent log std (clamped to [-20, 2]) of a
    Gaussian over u; the action is tanh(u), scaled from [-1, 1] to the Box's bounds. `act` gives actions in the env's
    units, with the ActorCritic interface (the value is 0: SAC's critics are Q functions, kept by the learner).
    `logp_eps`: the log-density's eps (`squashed_gaussian_logprob`; sac.logp_eps)."""

    LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
    # behaviour cloning's floor on the std of u and margin from the bounds: a demonstrated action at a bound (the
    # gripper's +-1) is a point mass, whose likelihood would drive the log std down to the clamp above, where its
    # gradient is zero and SAC could never widen it again; with the floor the fit stops pulling it at log(0.05)
    BC_STD_MIN, BC_BOUND = 0.05, 1 - 1e-2

    def __init__(self, obs_dim: int, action_space: spaces.Space, hidden: tuple[int, ...] = (256, 256),
                 activation: str = "relu", logp_eps: float = 0.0):
        super().__init__()
        if not isinstance(action_space, spaces.Box) or not np.all(np.isfinite(action_space.low)) or not np.all(
                np.isfinite(action_space.high)):
            raise ValueError(f"SAC needs a bounded Box action space (its actions are squashed into the bounds), got "
                             f"{action_space}")
        self.action_space, self.obs_dim, self.chunk, self.logp_eps = action_space, obs_dim, 1, logp_eps
        self.act_shape = tuple(action_space.shape)
        dim = math.prod(self.act_shape)
        self.trunk = _mlp(obs_dim, tuple(hidden), ACTIVATIONS[activation], ortho=False)
        width = hidden[-1] if hidden else obs_dim
        self.mu, self.log_std_head = nn.Linear(width, dim), nn.Linear(width, dim)
        low, high = (torch.tensor(np.array(b, np.float32)).reshape(-1) for b in (action_space.low, action_space.high))
        self.register_buffer("scale", (high - low) / 2, persistent=False)
        self.register_buffer("bias", (high + low) / 2, persistent=False)

    def dist(self, obs: torch.Tensor, std_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """obs [B, *obs] -> (mean, log std) of u, each [B, A]; `std_grad=False`: the log std's gradient stops at its
        head (the trunk learns from the mean only)."""
        x = torch.as_tensor(obs, device=self.mu.weight.device).float().flatten(1)
        if x.shape[1] != self.obs_dim:
            raise ValueError(f"SquashedGaussianActor: obs of shape {tuple(obs.shape)} flatten to {x.shape[1]} "
                             f"features, expected obs_dim={self.obs_dim}")
        h = _run(self.trunk, x)
        return self.mu(h), self.log_std_head(h if std_grad else h.detach()).clamp(self.LOG_STD_MIN, self.LOG_STD_MAX)

    def sample(self, obs: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterized: u = mean + std eps -> (tanh(u) in [-1, 1] [B, A], log pi [B]); gradients flow."""
        mean, log_std = self.dist(obs)
        u = mean + log_std.exp() * eps
        return torch.tanh(u), squashed_gaussian_logprob(u, mean, log_std, self.logp_eps)

    def to_env(self, unit: torch.Tensor) -> torch.Tensor:
        """[-1, 1] -> the Box's units, shaped [B, *act]."""
        return (unit * self.scale + self.bias).view(-1, *self.act_shape)

    def to_unit(self, actions: torch.Tensor) -> torch.Tensor:
        """The Box's units [B, *act] -> [-1, 1] [B, A] (what the critics read)."""
        return (actions.reshape(len(actions), -1).float() - self.bias) / self.scale

    def act(self, obs: torch.Tensor, deterministic: bool = False):
        """obs -> (action in the env's units [B, *act], log pi [B], value 0 [B]); deterministic: tanh(mean)."""
        mean, log_std = self.dist(obs)
        if deterministic:
            return self.to_env(torch.tanh(mean)), torch.zeros(len(mean)), torch.zeros(len(mean))
        unit, logp = self.sample(obs, torch.randn_like(mean))
        return self.to_env(unit), logp, torch.zeros(len(mean))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(obs))

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor):
        """For behaviour cloning: obs, actions in the env's units [B, *act] -> (log pi [B] of the actions pulled
        BC_BOUND inside the bounds, with the std floored at BC_STD_MIN; the entropy [B] of the Gaussian over u
        before the squash (the squashed one has no closed form); value 0 [B]). log pi's value is exact; its gradient
        is shaped so that the mean fits every state (measured on PickCube's 100 demonstrations, 30 held-out
        episodes: 50% success, against 10% with the plain likelihood's gradient):
        - the mean's gradient is that of the squared error in u, not the likelihood's (which is it divided by the
          std squared): a std that depends on the state would otherwise widen at the steps hardest to fit instead
          of fitting them (the gripper's wrong sign at 4-8% of PickCube's demonstrated steps);
        - the std's head fits the residuals on the trunk's features without training the trunk."""
        mean, log_std = self.dist(obs, std_grad=False)
        log_std = log_std.clamp(min=math.log(self.BC_STD_MIN))
        u = torch.atanh(self.to_unit(actions).clamp(-self.BC_BOUND, self.BC_BOUND))
        squared = 0.5 * (u - mean).pow(2).sum(-1)
        logprob = squashed_gaussian_logprob(u, mean.detach(), log_std, self.logp_eps) - (squared - squared.detach())
        entropy = (log_std + 0.5 + _HALF_LOG_2PI).sum(-1)
        return logprob, entropy, torch.zeros(len(mean))

    def scale_std(self, factor: float) -> None:
        """Multiply the std of u by `factor` everywhere (policy.init_std_scale), through the log std head's bias."""
        with torch.no_grad():
            self.log_std_head.bias += math.log(factor)


class Critics(nn.Module):
    """SAC's critics Q_1..Q_n(obs, action in [-1, 1]), n separate MLPs on [obs; action] (n = 2: SB3's twin critics;
    10: RLPD's ensemble) -> Q [n, B]; `layernorm`: a LayerNorm after every hidden layer (RLPD's critics: the features
    stay bounded, so Q cannot run away with its inputs)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: tuple[int, ...] = (256, 256), activation: str = "relu",
                 layernorm: bool = False, n: int = 2):
        super().__init__()
        act = ACTIVATIONS[activation]
        width = hidden[-1] if hidden else obs_dim + act_dim
        self.qs = nn.ModuleList(nn.Sequential(_mlp(obs_dim + act_dim, tuple(hidden), act, ortho=False,
                                                   layernorm=layernorm), nn.Linear(width, 1)) for _ in range(n))

    def forward(self, obs: torch.Tensor, unit_actions: torch.Tensor, which: list[int] | None = None) -> torch.Tensor:
        """Q [n, B], or the critics `which` [len(which), B] (the others are not run)."""
        x = torch.cat([obs.float().flatten(1), unit_actions], dim=1)
        return torch.stack([self.qs[i](x).squeeze(-1) for i in (range(len(self.qs)) if which is None else which)])
