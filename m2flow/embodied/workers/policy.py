"""Policy (embodied rollout) worker: batched inference for env stages. It takes a request per stage (obs, plus the
final obs of episodes truncated on the previous step) and answers with actions, logprobs and values. It never steps
an env and never trains.

Sampling noise is a function of (seed, time step, global env index) only, so the actions an env gets do not depend on
how the envs are cut into stages or workers: pipelining changes timing, not data.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from m2flow.embodied.policies import (ActorCritic, SquashedGaussianActor, build_policy, categorical_logprob,
                                     gaussian_logprob, gumbel_noise)
from m2flow.embodied.vla import GaussianVLA, TokenVLA, build_vla
from m2flow.runtime import Worker
from m2flow.runtime.compression import inflate
from m2flow.runtime.weights import WeightsRef, load_into, loaded_digest


def make_policy(cfg, obs_space, action_space) -> ActorCritic | SquashedGaussianActor:
    """The actor-critic of `cfg.policy` for these spaces (SAC: its squashed-Gaussian actor), initialized from
    `run.seed` (the global RNG is left as is)."""
    p = cfg.policy
    if cfg.algorithm.name == "sac":
        with torch.random.fork_rng():
            torch.manual_seed(cfg.run.seed)
            return SquashedGaussianActor(int(np.prod(obs_space.shape)), action_space, tuple(p.hidden), p.activation,
                                         cfg.sac.logp_eps)
    if p.kind == "vla":
        return _make_vla(cfg, obs_space, action_space)
    kw = dict(features_dim=p.features_dim) if p.kind == "cnn" else dict(hidden=tuple(p.hidden), activation=p.activation)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.run.seed)
        policy = build_policy(obs_space, action_space, p.kind, chunk=cfg.env.chunk, log_std_init=p.log_std_init, **kw)
        if not p.ortho_init:  # torch's default init (SB3 ortho_init=False); log_std keeps its init
            for m in policy.modules():
                if isinstance(m, (nn.Linear, nn.Conv2d)):
                    m.reset_parameters()
    return policy


def _make_vla(cfg, obs_space, action_space) -> GaussianVLA | TokenVLA:
    """policy.kind=vla on ManiSkill3's packed pixel observations (`pixel_layout(env.image_size, env.wrist_camera)`)."""
    from m2flow.embodied.envs.maniskill import VOCAB, pixel_layout

    layout, v = pixel_layout(cfg.env.image_size, cfg.env.wrist_camera), cfg.vla
    if tuple(obs_space.shape) != (layout.nbytes,) or obs_space.dtype != np.uint8:
        raise ValueError(f"policy.kind=vla reads packed pixel rows [{layout.nbytes}] uint8 (env.pixels=true, "
                         f"env.image_size={cfg.env.image_size}, env.wrist_camera={cfg.env.wrist_camera}), got "
                         f"{obs_space}")
    with torch.random.fork_rng():
        torch.manual_seed(cfg.run.seed)
        return build_vla(layout, action_space, len(VOCAB), v.head, chunk=cfg.env.chunk,
                         log_std_init=cfg.policy.log_std_init, bins=v.bins, dim=v.dim, layers=v.layers,
                         heads=v.heads, patch=v.patch, value_hidden=tuple(v.value_hidden))


@torch.no_grad()
def sample_actions(policy: ActorCritic, obs: torch.Tensor, noise_seed: int | None, lo: int, total: int):
    """obs [n, *obs] of envs lo..lo+n (of `total`) -> (actions, logprobs [n], values [n]).

    noise_seed None: the distribution's mode (deterministic). Else Gaussian actions are mean + std * eps and
    discrete ones argmax(logits + Gumbel noise) (an exact sample), with eps drawn for all `total` envs from
    `noise_seed` and sliced: env i gets the same noise whatever stage it is in.
    """
    if noise_seed is None:
        return policy.act(obs, deterministic=True)
    if isinstance(policy, SquashedGaussianActor):
        return _sample_sac(policy, obs, noise_seed, lo, total)
    if isinstance(policy, TokenVLA):  # its own decoder, with the same per-env noise
        return policy.sample(obs, noise_seed, lo, total)
    actor_feat, critic_feat = policy.features(obs)
    out = policy.head(actor_feat)  # means or logits, in closed form below: a third of a distribution's ops
    gen = torch.Generator().manual_seed(noise_seed)
    n = obs.shape[0]
    if isinstance(policy.action_space, spaces.Box):
        log_std = policy.log_std_of(out)
        eps = torch.randn((total, *out.shape[1:]), generator=gen)[lo:lo + n]
        action = out + torch.exp(log_std) * eps
        logprob = policy._sum(gaussian_logprob(action, out, log_std))
    else:
        u = torch.rand((total, *out.shape[1:]), generator=gen)[lo:lo + n]
        log_p = torch.log_softmax(out, -1)
        index = (log_p + gumbel_noise(u)).argmax(-1)
        logprob = policy._sum(categorical_logprob(log_p, index))
        action = index + int(policy.action_space.start)
    return action, logprob, policy.critic_head(critic_feat).squeeze(-1)


def _sample_sac(policy: SquashedGaussianActor, obs: torch.Tensor, noise_seed: int, lo: int, total: int):
    """sample_actions for SAC's actor: u = mean + std eps, eps as above, squashed into the Box's bounds."""
    eps = torch.randn((total, *policy.mu.bias.shape), generator=torch.Generator().manual_seed(noise_seed))
    unit, logprob = policy.sample(obs, eps[lo:lo + len(obs)])
    return policy.to_env(unit), logprob, torch.zeros(len(obs))


def uniform_actions(space: spaces.Box, noise_seed: int, lo: int, n: int, total: int) -> np.ndarray:
    """Actions drawn uniformly from the Box (SAC's first `learning_starts` env steps), env i's as above."""
    gen = torch.Generator().manual_seed(noise_seed)
    u = torch.rand((total, *space.shape), generator=gen, dtype=torch.float64)[lo:lo + n].numpy()
    return (space.low + u * (space.high - space.low)).astype(space.dtype)


def readonly_tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor view of an array Ray delivered read-only (it is never written to)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def noise_seed(seed: int, t: int) -> int:
    """The sampling-noise seed of policy time step t (shared by every env at that step)."""
    return (seed * 1_000_003 + t * 7_919 + 17) % (2**63)


class PolicyWorker(Worker):
    """Answers env workers' requests one at a time, in arrival order: `act(request) -> reply` with
    request {stage, t, lo, total, obs [n, *obs], final_obs [m, *obs] | None, values_only, step, trace} and
    reply {actions, logprobs, values (or only values), final_values [m] | None, seconds}. Arrays are numpy: Ray
    pickles them out of band in microseconds, torch tensors take a slow path (~0.25 ms each on a loaded core)."""

    def __init__(self, cfg, obs_space, action_space):
        self.cfg = cfg
        torch.distributions.Distribution.set_default_validate_args(False)  # this process only builds valid ones
        self.policy = make_policy(cfg, obs_space, action_space).eval()
        self.version = 0
        # SAC acts uniformly at random for its first learning_starts env steps (all envs), as SB3
        self.random_until = cfg.sac.learning_starts if cfg.algorithm.name == "sac" else 0

    @torch.no_grad()
    def act(self, req: dict) -> dict:
        start, wall = time.perf_counter(), time.time()
        obs, final = readonly_tensor(inflate(req["obs"])), req["final_obs"]  # frames from another node: compressed
        m = 0 if final is None else len(final)
        if req["values_only"]:  # the rollout's bootstrap: V(next obs), no action
            values = self.policy.value(torch.cat([obs, readonly_tensor(final)]) if m else obs)
            reply = {"values": values[:len(obs)].numpy()}
        else:
            nseed = None if self.cfg.rollout.deterministic else noise_seed(self.cfg.run.seed, req["t"])
            actions, logprobs, values = sample_actions(self.policy, obs, nseed, req["lo"], req["total"])
            reply = {"actions": actions.numpy(), "logprobs": logprobs.numpy(), "values": values.numpy()}
            if self.random_until and req["t"] * req["total"] < self.random_until:  # SAC's learning_starts
                seed = noise_seed(self.cfg.run.seed + 1, req["t"])
                reply["actions"] = uniform_actions(self.policy.action_space, seed, req["lo"], len(obs), req["total"])
            if m:
                values = torch.cat([values, self.policy.value(readonly_tensor(final))])
        reply["final_values"] = values[len(obs):].numpy() if m else None
        reply["seconds"] = time.perf_counter() - start
        if req["trace"]:
            self.tracer.record(f"policy s{req['stage']}", wall, time.time(), req["step"], env_rank=req["env_rank"])
        return reply

    def load_weights(self, weights: WeightsRef) -> str | None:
        """Copy the actor's published weights in place; returns their digest (None when not checked)."""
        with self.span("weight_sync", weights.version):
            load_into(self.policy, weights)
            self.version = weights.version
        return loaded_digest(self.policy, weights)
