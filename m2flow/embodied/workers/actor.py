"""Embodied actor worker: PPO (GAE with truncation bootstrap) or embodied GRPO updates of the actor-critic from the
env workers' trajectories; publishes weights and writes checkpoints. It never steps an env.

Several ranks train data-parallel: every rank receives all trajectories, takes the same minibatches (one seeded
order) and computes its share of each; gradients are averaged with an all-reduce (gloo on CPU), so every rank keeps
the same weights. `actor: 0-1:0` (one process over both devices' cores) avoids the all-reduce.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from m2flow.algorithms import (embodied_grpo_advantages, first_episode_mask, gae, sample_policy_loss, sample_value_loss,
                               shift_values)
from m2flow.embodied.bc import demo_data
from m2flow.embodied.envs import Trajectory
from m2flow.embodied.workers.policy import make_policy
from m2flow.engines.guards import check_weight_growth, first_nonfinite, nonfinite_update, sum_of_squares
from m2flow.runtime import Worker
from m2flow.runtime.files import load_plain
from m2flow.runtime.stream import producers_of
from m2flow.runtime.sync import PublishesWeights
from m2flow.runtime.weights import publish


def advantages(traj: Trajectory, cfg, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """-> (advantages [T, N], returns [T, N], mask [T, N] of the steps that train).

    ppo: GAE; truncated steps bootstrap from V(final obs), terminated ones from 0. grpo: each env's group-normalized
    outcome (scores [N]; groups of env.seed_groups consecutive envs) on the steps of its first episode; returns are
    the GAE targets all the same, so a critic can still be fit (vf_coef 0 turns it off)."""
    alg = cfg.algorithm
    next_values = shift_values(traj.values, traj.next_values, traj.truncated, traj.final_values)
    adv, returns = gae(traj.rewards, traj.values, traj.terminated, traj.truncated, next_values, alg.gamma, alg.lam)
    if alg.name == "ppo":
        return adv, returns, torch.ones_like(adv, dtype=torch.bool)
    mask = first_episode_mask(traj.terminated | traj.truncated)
    return embodied_grpo_advantages(scores, mask, cfg.env.seed_groups), returns, mask


def minibatch_loss(policy, obs, actions, old_logp, old_v, adv, returns, clip: torch.Tensor, alg):
    """The PPO loss of one minibatch (shapes [B, ...]) -> (clipped surrogate + vf_coef * MSE - ent_coef * entropy,
    [pg_loss, vf_loss (MSE), entropy, approx_kl, clipfrac]). `adv` comes normalized where alg.norm_adv (ppo_update
    does it over the whole minibatch, before splitting it between ranks). `clip` is a 0-d tensor, so a compiled copy
    keeps one graph while the clip range anneals."""
    logp, entropy, values = policy.evaluate(obs, actions)
    pg, approx_kl, clipfrac = sample_policy_loss(logp, old_logp, adv, clip)
    vf = sample_value_loss(values, old_v, returns, clip=alg.clip_vf)
    ent = entropy.mean()
    loss = pg + alg.vf_coef * 2.0 * vf - alg.ent_coef * ent  # the value loss is 0.5 * MSE
    return loss, torch.stack([pg.detach(), 2 * vf.detach(), ent.detach(), approx_kl, clipfrac])


STATS = ("actor/pg_loss", "actor/vf_loss", "actor/entropy", "actor/approx_kl", "actor/clipfrac")


class DemoTerm:
    """DAPG's behaviour-cloning term beside the RL loss: coef x the negative log-likelihood of `size` demonstrated
    (obs, action) rows, drawn afresh for every minibatch. The draws are seeded by (seed, iteration), each rank its own
    seed, so a resumed run draws what an uninterrupted one does."""

    def __init__(self, data: dict[str, torch.Tensor], size: int, seed: int):
        self.obs, self.actions = data["obs"], data["actions"]
        self.size, self.seed = min(size, len(self.obs)), seed

    def at(self, step: int, coef: float) -> Callable[[object], tuple[torch.Tensor, torch.Tensor]]:
        """The term of iteration `step`: policy -> (coef x NLL to add to a minibatch's loss, the NLL, detached)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)

        def term(policy) -> tuple[torch.Tensor, torch.Tensor]:
            rows = torch.randint(0, len(self.obs), (self.size,), generator=gen)
            nll = -policy.evaluate(self.obs[rows], self.actions[rows])[0].mean()
            return coef * nll, nll.detach()

        return term


def ppo_update(policy, optimizer, traj: Trajectory, adv, returns, mask, cfg, frac: float, gen: torch.Generator,
               rank: int = 0, world: int = 1, allreduce=None, loss_fn=minibatch_loss,
               bc: Callable[[object], tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict:
    """Epochs x minibatches of `loss_fn` (minibatch_loss, or a compiled copy of it) over the flattened [T, N] steps
    where mask. frac in (0, 1]: the share of the run left (LR and clip annealing). Each epoch gathers the data
    once in a seeded order and takes minibatches as slices; with `world` ranks each takes every world-th sample of
    a minibatch and `allreduce(grads)` averages the flat gradient buffer over them. `bc(policy)` -> (a term added
    to every minibatch's loss, its NLL): DAPG's behaviour cloning. Returns metrics."""
    a, alg = cfg.actor, cfg.algorithm
    keep = mask.reshape(-1)
    flat = lambda x: x.reshape(-1, *x.shape[2:])[keep]  # noqa: E731
    data = [flat(x) for x in (traj.obs, traj.actions, traj.logprobs, traj.values, adv, returns)]
    old_v, returns = data[3], data[5]
    for group in optimizer.param_groups:  # each group's own base rate (value_param_groups), else actor.lr
        group["lr"] = group.get("base_lr", a.lr) * (frac if a.anneal_lr else 1.0)
    clip = max(alg.clip * (frac if alg.anneal_clip else 1.0), 1e-8)
    clip_t = torch.tensor(clip)  # a tensor: a compiled loss_fn keeps one graph while the clip anneals
    params = [p for p in policy.parameters() if p.requires_grad]
    grads = flat_grads(params)
    size = len(returns)
    stats, grad_norms, stop, skipped, bc_nlls = [], [], False, 0, []
    for _ in range(a.epochs):
        order = torch.randperm(size, generator=gen)
        shuffled = [x[order] for x in data]
        for lo in range(0, size, a.minibatch_size):
            mb = [x[lo:lo + a.minibatch_size] for x in shuffled]
            if alg.norm_adv and len(mb[4]) > 1:  # over the whole minibatch, before any rank takes its share
                mb[4] = (mb[4] - mb[4].mean()) / (mb[4].std() + 1e-8)
            if world > 1:
                mb = [x[rank::world] for x in mb]
            loss, s = loss_fn(policy, *mb, clip_t, alg)
            if bc is not None:
                term, nll = bc(policy)
                loss = loss + term
                bc_nlls.append(nll)
            grads.zero_()
            loss.backward()  # accumulates into the views of `grads`
            if allreduce is not None:
                allreduce(grads)
            norm = torch.linalg.vector_norm(grads)  # clip_grad_norm_'s arithmetic on one tensor, not one per param
            if not bool(torch.isfinite(norm)):  # averaged over the ranks: they all stop, or all skip
                culprit = "the minibatch loss" if not bool(torch.isfinite(loss)) else first_nonfinite(
                    (f"the gradient of {n}", q.grad) for n, q in policy.named_parameters())
                nonfinite_update(float(norm), culprit, a.nonfinite)
                skipped += 1
                continue
            grads.mul_((a.grad_clip / (norm + 1e-6)).clamp(max=1.0))
            grad_norms.append(norm)
            optimizer.step()
            stats.append(s)
            if alg.target_kl is not None and mean_over_ranks(s[3], allreduce) > 1.5 * alg.target_kl:
                stop = True  # on the ranks' mean KL: every rank stops at the same minibatch (else the others
                break  # would wait in the next all-reduce for ever)
        if stop:
            break
    means = torch.stack(stats).mean(0).tolist() if stats else [0.0] * len(STATS)
    out = dict(zip(STATS, means))
    var = returns.var()
    out.update({"actor/explained_var": float(1 - (returns - old_v).var() / var) if var > 0 else 0.0,
                "actor/grad_norm": float(torch.stack(grad_norms).mean()) if grad_norms else 0.0,
                "actor/nonfinite_skipped": skipped, "actor/lr": optimizer.param_groups[0]["lr"],
                **({"actor/critic_lr": optimizer.param_groups[1]["lr"]} if len(optimizer.param_groups) > 1 else {}),
                "actor/clip": clip, "actor/updates": len(stats), "actor/early_stop": float(stop),
                "actor/advantage_mean": float(data[4].mean())})
    if bc_nlls:
        out["actor/bc_nll"] = float(torch.stack(bc_nlls).mean())
    return out


def value_param_groups(policy: torch.nn.Module, lr: float, critic_lr: float | None) -> list[dict]:
    """The optimizer's parameter groups: one at `lr`; with `critic_lr`, the value function's own parameters (those
    of the modules named critic*: the critic network and the value head, never an encoder the action head reads
    too) in a second group at that rate. Each group keeps its rate as `base_lr`, which ppo_update anneals from."""
    params = [p for p in policy.parameters() if p.requires_grad]
    if critic_lr is None:
        return [{"params": params, "lr": lr, "base_lr": lr}]
    value = {id(p) for n, p in policy.named_parameters() if n.split(".")[0].startswith("critic")}
    if not value:
        raise ValueError(f"actor.critic_lr: {type(policy).__name__} has no value-function parameters of its own "
                         f"(modules named critic*)")
    return [{"params": [p for p in params if id(p) not in value], "lr": lr, "base_lr": lr},
            {"params": [p for p in params if id(p) in value], "lr": critic_lr, "base_lr": critic_lr}]


def forget_idle_adam_state(optimizer: torch.optim.Optimizer) -> int:
    """Drop the Adam state of the parameters whose gradients were all zero so far (the policy's during a critic
    warmup): Adam stepped them all the same, so their step count would say the moments had settled while both are
    still 0, and the first real updates would take steps of up to about twice the learning rate. They start afresh.
    Returns how many parameters it reset."""
    idle = [p for p, st in optimizer.state.items() if "exp_avg_sq" in st and not st["exp_avg_sq"].any()]
    for p in idle:
        del optimizer.state[p]
    return len(idle)


def mean_over_ranks(value: torch.Tensor, allreduce: Callable[[torch.Tensor], None] | None) -> float:
    """A scalar averaged over the actor ranks with `allreduce` (None: one rank, the value itself)."""
    if allreduce is None:
        return float(value)
    buf = value.detach().reshape(1).clone()
    allreduce(buf)
    return float(buf)


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """A zeroed buffer for all of `params`' gradients, each `p.grad` set to a view of it: backward accumulates into
    it in place, so zeroing and clipping are one op each instead of one per tensor (a small MLP's 13 tensors: ~0.1 ms
    less per minibatch on CPU)."""
    buf = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = buf[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return buf


def allreduce_grads(grads: torch.Tensor) -> None:
    """Average the flat gradient buffer (see flat_grads) over the actor ranks: one gloo all-reduce, in place."""
    import torch.distributed as dist

    dist.all_reduce(grads)
    grads /= dist.get_world_size()


class EmbodiedActorWorker(PublishesWeights, Worker):
    def __init__(self, cfg, obs_space, action_space):
        self.cfg = cfg
        self.policy = make_policy(cfg, obs_space, action_space).train()
        start_policy(self.policy, cfg)  # e.g. a behaviour-cloned policy; the first weight sync hands it to the rollout
        torch.distributions.Distribution.set_default_validate_args(False)  # argument checks cost ~10% of a step
        # fused Adam: one kernel per step instead of ~13 small ops per tensor (15% of a small MLP's update on CPU)
        self.optimizer = torch.optim.Adam(value_param_groups(self.policy, cfg.actor.lr, cfg.actor.critic_lr),
                                          lr=cfg.actor.lr, eps=cfg.actor.adam_eps, fused=True)
        self.gen = torch.Generator().manual_seed(cfg.run.seed + 12345)  # minibatch order, same on every rank
        # compiled: forward and backward fused by inductor, ~25% less time per minibatch on CPU after ~20 s of
        # compiling on the first update (cached under /tmp/torchinductor_* for later runs)
        self.loss_fn = torch.compile(minibatch_loss) if cfg.actor.compile else minibatch_loss
        self.version = 0
        if self.world_size > 1:  # the policies (small MLPs) stay on the CPU, GPU devices or not: gloo
            self.init_process_group("gloo")
        self.register_offloadable("policy", self.policy)
        self.register_offloadable("optimizer", self.optimizer)
        a = cfg.actor
        self.demos = DemoTerm(demo_data(a.bc_demos, cfg.env.id, cfg.env.instruct, cfg.env.chunk,
                                        pixels=cfg.env.pixels, image_size=cfg.env.image_size,
                                        render_triangles=cfg.env.render_triangles,
                                        wrist_camera=cfg.env.wrist_camera), a.minibatch_size,
                              cfg.run.seed + 777 + self.rank) if a.bc_coef > 0 else None

    def train(self, inp, step: int, producers: int | None = None) -> dict:
        """One update from the `producers` env workers' trajectories on `inp` (key: this rank; default: the channel's
        producers)."""
        items = sorted((inp.get(key=self.rank) for _ in range(producers_of(inp, producers))),
                       key=lambda x: x["env_rank"])
        traj = Trajectory.cat_envs([x["traj"] for x in items])
        scores = torch.cat([x["scores"] for x in items]) if items[0]["scores"] is not None else None
        with self.device_phase("train", step):
            start = time.perf_counter()
            adv, returns, mask = advantages(traj, self.cfg, scores)
            warmup = step < self.cfg.actor.critic_warmup
            if step == self.cfg.actor.critic_warmup > 0:
                forget_idle_adam_state(self.optimizer)
            if warmup:  # no advantage, no policy gradient: the updates fit the value function alone
                adv = torch.zeros_like(adv)
            frac = 1.0 - step / max(self.cfg.run.steps, 1)
            limit = self.cfg.actor.max_weight_growth
            before = math.sqrt(sum_of_squares(self.policy.parameters())) if limit else 0.0
            on = self.demos is not None and not warmup
            coef = self.cfg.actor.bc_coef * self.cfg.actor.bc_decay ** step if on else 0.0
            bc = self.demos.at(step, coef) if coef > 0 else None
            out = ppo_update(self.policy, self.optimizer, traj, adv, returns, mask, self.cfg, frac, self.gen,
                             self.rank, self.world_size, allreduce_grads if self.world_size > 1 else None,
                             self.loss_fn, bc)
            if self.demos is not None:
                out["actor/bc_coef"] = coef
            if limit:
                check_weight_growth(before, math.sqrt(sum_of_squares(self.policy.parameters())), limit,
                                    self.cfg.actor.lr)
            out["time/update"] = time.perf_counter() - start
            out["actor/critic_warmup"] = float(warmup)
        if scores is not None:
            out["grpo/score_mean"] = float(scores.mean())
        self.version += 1
        return out

    # -- weights and checkpoints -----------------------------------------------------------------
    def publish_weights(self, check: bool = True, local: bool = False):
        """The policy's weights, with their digest when the receivers' copies are to be `check`ed; `local`: for
        receivers in this process only (no object store)."""
        return publish(self.policy.state_dict(), self.version, digest=check, local=local)

    def save_checkpoint(self, directory: str) -> None:
        """policy.safetensors + actor_state.pt (optimizer, minibatch RNG, version) under `directory`."""
        from safetensors.torch import save_file

        d = Path(directory)
        save_file({k: v.contiguous() for k, v in self.policy.state_dict().items()}, str(d / "policy.safetensors"))
        torch.save({"optimizer": self.optimizer.state_dict(), "gen": self.gen.get_state(), "version": self.version,
                    "torch_rng": torch.get_rng_state()}, d / "actor_state.pt")

    def load_checkpoint(self, directory: str) -> int:
        d = Path(directory)
        load_policy(self.policy, d)
        s = load_plain(d / "actor_state.pt")
        self.optimizer.load_state_dict(s["optimizer"])
        self.gen.set_state(s["gen"])
        self.version = s["version"]
        torch.set_rng_state(s["torch_rng"])
        return self.version


def start_policy(policy, cfg) -> None:
    """policy.init: load that checkpoint's policy, then scale its std by policy.init_std_scale."""
    if cfg.policy.init:
        load_policy(policy, Path(cfg.policy.init), critic=cfg.policy.init_critic)
        if cfg.policy.init_std_scale != 1.0:
            policy.scale_std(cfg.policy.init_std_scale)


def load_policy(policy, directory: Path, critic: bool = True) -> None:
    """Load directory/policy.safetensors into `policy`, with a clear error if it was built differently; `critic`
    False: not the value function's parameters (the modules named critic*), which keep their initialization."""
    from safetensors.torch import load_file

    state = load_file(str(Path(directory) / "policy.safetensors"))
    if not critic:  # the value function's own tensors stand in for the checkpoint's
        state.update({k: v.detach().clone() for k, v in policy.state_dict().items()
                      if k.split(".")[0].startswith("critic")})
    own = policy.state_dict()
    bad = sorted(k for k in set(own) | set(state) if k not in own or k not in state or own[k].shape != state[k].shape)
    if bad:
        hint = "; policy.init_critic=false loads it without them" if critic and all(
            k.split(".")[0].startswith("critic") for k in bad) else ""
        raise ValueError(f"{directory}/policy.safetensors does not fit the policy of this config: {bad[:4]} differ"
                         f"{hint}")
    policy.load_state_dict(state)
