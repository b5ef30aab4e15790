"""SAC learner worker: the off-policy flow's `actor` component. It takes the env workers' trajectories into its
replay buffer, takes SAC gradient steps on minibatches sampled from it (twin critics or an ensemble, with
Polyak-averaged targets; the squashed-Gaussian actor; the entropy temperature), publishes the actor's weights and
writes checkpoints that hold the buffer and every generator, so a resumed run continues as an uninterrupted one. It
never steps an env.

The order within an iteration is the plan's staleness contract (`sac.max_policy_lag`): 0 takes the iteration's
env steps into the buffer first, then updates (SB3's collect-then-train); 1 updates on the steps gathered so far
while the env workers collect the next ones, and takes those in afterwards, so collection and learning overlap when
the plan puts them on different devices.

With `sac.demos` (RLPD's sampling) a second buffer holds the demonstrations' transitions, and every minibatch
draws `sac.demo_fraction` of its rows from it.

A gradient step is `update`: SAC as SB3 writes it (the temperature, the critics, the actor through the critics just
stepped, the targets), by autograd or, under `sac.grad=manual`, by the gradients written out (`manual_update`, the same
numbers to float rounding). The learner takes an iteration's steps through `self.steps`: `SerialSteps` (one `update`
after another) unless `sac.parallel_update` opts in to the speed-ups of m2flow.embodied.sac.parallel, which take the
same interface.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from m2flow.algorithms import actor_loss, critic_loss, polyak_update, soft_td_target, temperature_loss
from m2flow.algorithms.sac_grad import actor_loss_grads, critics_loss_grads, mlp_layers, squashed_sample
from m2flow.embodied.bc import demo_transitions
from m2flow.embodied.envs import Trajectory
from m2flow.embodied.policies import Critics
from m2flow.embodied.sac.parallel import parallel_steps
from m2flow.embodied.sac.replay import ReplayBuffer, transitions
from m2flow.embodied.workers.actor import load_policy, start_policy
from m2flow.embodied.workers.policy import make_policy
from m2flow.engines.guards import nonfinite_update
from m2flow.engines.optim import FusedAdamStep
from m2flow.runtime import Worker
from m2flow.runtime.files import load_plain
from m2flow.runtime.stream import producers_of
from m2flow.runtime.sync import PublishesWeights
from m2flow.runtime.weights import publish

REPLAY_FILE = "replay.safetensors"  # in a checkpoint: the online buffer (sac.save_buffer)
STATS = ("sac/critic_loss", "sac/actor_loss", "sac/alpha", "sac/entropy", "sac/q_mean", "sac/bc_loss")


class SerialSteps:
    """An iteration's gradient steps one after another, each `SACLearnerWorker.update`. The interface the learner
    takes its steps through (m2flow.embodied.sac.parallel's speed-ups take it too): `run(n)` -> the stats of the n
    steps not dropped; `warm_up()` in the iterations before learning starts; `reset()` once the learner's state was
    replaced (a checkpoint loaded)."""

    def __init__(self, learner: "SACLearnerWorker"):
        self.learner = learner

    def run(self, n: int) -> list[torch.Tensor]:
        return [x for x in (self.learner.update() for _ in range(n)) if x is not None]

    def warm_up(self) -> None:
        pass

    def reset(self) -> None:
        pass


class SACLearnerWorker(PublishesWeights, Worker):
    def __init__(self, cfg, obs_space, action_space):
        if self.world_size > 1:
            raise ValueError(f"algorithm.name=sac trains on one actor rank (the placement gives it "
                             f"{self.world_size}); place the actor on one device, e.g. 'actor: 0-1:0'")
        self.cfg, s = cfg, cfg.sac
        self.policy = make_policy(cfg, obs_space, action_space).train()
        start_policy(self.policy, cfg)
        dims = math.prod(self.policy.act_shape)
        with torch.random.fork_rng():
            torch.manual_seed(cfg.run.seed + 1)
            self.critic = Critics(self.policy.obs_dim, dims, tuple(cfg.policy.hidden), cfg.policy.activation,
                                  layernorm=s.critic_layernorm, n=s.n_critics)
        self.target = copy.deepcopy(self.critic).requires_grad_(False)
        alpha, self.tuned = s.alpha_init()
        self.log_alpha = torch.tensor(math.log(alpha), requires_grad=self.tuned)
        self.target_entropy = s.target(dims)
        lr = cfg.actor.lr
        # fused Adam: one kernel per step instead of a dozen small ops per tensor
        self.actor_opt = torch.optim.Adam(self.policy.parameters(), lr=lr, fused=True)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=lr, fused=True)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr, fused=True) if self.tuned else None
        # their steps without Adam.step's per-call bookkeeping (~0.2 ms a call, 3 calls a gradient step)
        self.actor_step, self.critic_step = FusedAdamStep(self.actor_opt).step, FusedAdamStep(self.critic_opt).step
        self.alpha_step = FusedAdamStep(self.alpha_opt).step if self.tuned else None
        self.buffer = ReplayBuffer(s.buffer_size, tuple(obs_space.shape), self.policy.act_shape,
                                   seed=cfg.run.seed + 4242)
        self.demos = None
        if s.demos:  # RLPD: a second buffer, of the demonstrations, fills part of every minibatch
            data = demo_transitions(s.demos, cfg.env.id, cfg.env.instruct, s.demo_episodes,
                                    sparse=cfg.env.kwargs.get("reward_mode") == "sparse",
                                    end_at_success=not cfg.env.kwargs.get("ignore_terminations", False))
            data["actions"] = self.policy.to_unit(data["actions"]).clamp(-1.0, 1.0)
            self.demos = ReplayBuffer(len(data["rewards"]), tuple(obs_space.shape), self.policy.act_shape,
                                      seed=cfg.run.seed + 4343)
            self.demos.add(data)
        self.gen = torch.Generator().manual_seed(cfg.run.seed + 777)  # the updates' reparameterization noise
        self.manual = self._manual_networks()
        self._polyak_pairs = (list(self.target.parameters()), list(self.critic.parameters()))  # updated in place
        self.version, self.updates, self.env_steps = 0, 0, 0
        self.steps = parallel_steps(self) if s.parallel_update else SerialSteps(self)

    def _manual_networks(self) -> dict | None:
        """sac.grad: the networks as the hand-written gradients read them (their parameters, and their `.grad`
        tensors, kept from here on, to write into), or None for autograd."""
        if self.cfg.sac.grad == "autograd" or self.cfg.sac_grad_blockers():  # manual with blockers: a config error
            return None
        for p in [*self.policy.parameters(), *self.critic.parameters()]:
            p.grad = torch.zeros_like(p)

        def grads(nets):
            return [tuple(p.grad for p in layer) for layer in nets]

        pol = self.policy
        trunk, heads = mlp_layers(pol.trunk), [*mlp_layers(pol.mu), *mlp_layers(pol.log_std_head)]
        critics = [(mlp_layers(q[0]), mlp_layers(q[1])[0]) for q in self.critic.qs]
        return {"actor": (trunk, *heads), "actor_grads": (grads(trunk), *grads(heads)), "critics": critics,
                "critic_grads": [(grads(hidden), grads([head])[0]) for hidden, head in critics],
                "bounds": (pol.LOG_STD_MIN, pol.LOG_STD_MAX)}

    def train(self, inp, step: int, producers: int | None = None, publish: bool | None = None) -> dict:
        """One iteration: take the `producers` env workers' trajectories on `inp` (key: this rank; default: the
        channel's producers) into the buffer and take the iteration's gradient steps, in the order of
        sac.max_policy_lag. `publish` (True: with their digest, False: without): publish the weights then held and
        return them under "weights", so that the flow needs no call of this process to sync them (one it may have
        queued behind its next `train` already)."""
        s = self.cfg.sac
        out, start, updating = {}, time.perf_counter(), 0.0
        if s.max_policy_lag:  # update on what the buffer holds while the env workers collect (a whole iteration's)
            out, updating = self._timed_updates(step, self._gradient_steps(s.train_freq * self.cfg.env.num_envs))
        added = self._take(inp, producers_of(inp, producers))
        if not s.max_policy_lag:
            out, updating = self._timed_updates(step, self._gradient_steps(added))
        self.version += 1
        if publish is not None:
            out["weights"] = self.publish_weights(publish)
        # time/update: the whole call (with taking the trajectories in); time/gradient_steps: the updates alone
        return {**out, "time/update": time.perf_counter() - start, "time/gradient_steps": updating,
                "sac/buffer_size": len(self.buffer),
                "sac/buffer_mib": self.buffer.nbytes / 2**20, "sac/updates_total": self.updates}

    def _timed_updates(self, step: int, n: int) -> tuple[dict, float]:
        """`_updates` -> (its result, its seconds: 0.0 when it took no gradient step, as before learning_starts)."""
        start = time.perf_counter()
        out = self._updates(step, n)
        return out, (time.perf_counter() - start if "sac/critic_loss" in out else 0.0)

    def _take(self, inp, producers: int) -> int:
        items = sorted((inp.get(key=self.rank) for _ in range(producers)), key=lambda x: x["env_rank"])
        batch = transitions(Trajectory.cat_envs([x["traj"] for x in items]))
        batch["actions"] = self.policy.to_unit(batch["actions"]).clamp(-1.0, 1.0)
        self.buffer.add(batch)
        self.env_steps += len(batch["rewards"])
        return len(batch["rewards"])

    def _gradient_steps(self, collected: int) -> int:
        """An iteration's gradient steps for `collected` env steps: sac.utd x collected when set, else
        sac.gradient_steps (-1: one per env step), so the update-to-data ratio is the same in every plan."""
        s = self.cfg.sac
        if s.utd is not None:
            return round(s.utd * collected)
        return s.gradient_steps if s.gradient_steps > 0 else collected

    def _updates(self, step: int, n: int) -> dict:
        """n gradient steps, once more than learning_starts env steps were collected (SB3's condition: its first
        update comes after its first train_freq steps past learning_starts) and the buffer holds as many (it holds
        fewer after resuming from a checkpoint without it: sac.save_buffer)."""
        starts = self.cfg.sac.learning_starts
        if self.env_steps <= starts or len(self.buffer) < min(max(starts, 1), self.buffer.capacity) or not n:
            self.steps.warm_up()
            return {"sac/updates": 0}
        with self.device_phase("train", step):
            done = self.steps.run(n)
        stats = torch.stack(done).mean(0).tolist() if done else [float("nan")] * len(STATS)
        out = {**dict(zip(STATS, stats)), "sac/updates": len(done), "actor/nonfinite_skipped": n - len(done)}
        if not self.cfg.sac.bc_coef:
            del out["sac/bc_loss"]
        return out

    def update(self) -> torch.Tensor | None:
        """One gradient step (temperature, critics, actor, targets, in SB3's order) -> its stats; None when it was
        dropped for a non-finite loss (actor.nonfinite=skip)."""
        b, eps = self.draw()
        alpha = self.log_alpha.detach().exp()  # this step's temperature, before its own update (as SB3)
        if self.manual is not None:
            with torch.no_grad():
                return self.manual_update(b, eps, alpha)
        pi, logp = self.policy.sample(b["obs"], eps[0])
        c_loss, q = self.critic_objective(b, eps[1], alpha)
        if not self.finite(c_loss):
            return None
        self.temperature_step(logp)
        self.critic_opt.zero_grad()
        c_loss.backward()
        self.critic_step()
        self.critic.requires_grad_(False)  # the actor's loss differentiates through the critics, not into them
        a_loss, bc = self.actor_objective(b, pi, logp, alpha)
        self.actor_opt.zero_grad()
        (a_loss + self.cfg.sac.bc_coef * bc).backward()
        self.actor_step()
        self.critic.requires_grad_(True)
        return self.after_step(c_loss, a_loss, bc, alpha, logp, q)

    def manual_update(self, b: dict, eps: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor | None:
        """sac.grad=manual: `update`'s step with the gradients written out (m2flow.algorithms.sac_grad) into the
        parameters' kept `.grad` tensors; under no_grad."""
        m, obs = self.manual, b["obs"].float().flatten(1)
        pi, logp, fwd = squashed_sample(*m["actor"], obs, eps[0], m["bounds"], self.policy.logp_eps)
        target = self.td_target(b, eps[1], alpha)
        c_loss, q = critics_loss_grads(m["critics"], torch.cat([obs, b["actions"]], 1), target, m["critic_grads"])
        if not self.finite(c_loss):
            return None
        self.manual_temperature_step(logp)
        self.critic_step()
        # SB3's order: the actor's gradient through the critics just stepped
        a_loss, bc = self.manual_actor_grads(b, obs, pi, logp, fwd, alpha)
        self.actor_step()
        return self.after_step(c_loss, a_loss, bc, alpha, logp, q[0].mean())

    def draw(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A step's minibatch and its reparameterization noise [2, B, action] (the actor's, the next actions')."""
        n = self.cfg.sac.batch_size
        return self._sample(n), torch.randn((2, n, *self.policy.mu.bias.shape), generator=self.gen)

    def manual_actor_grads(self, b: dict, obs, pi, logp, fwd, alpha, read: Future | None = None):
        """The actor's loss (actor_loss, and `actor_objective`'s BC term with sac.bc_coef) and its gradient into
        the actor's `.grad`s -> (the loss, the BC term). `read`: given log pi once the critics' weights are no
        longer read."""
        m, s = self.manual, self.cfg.sac
        return actor_loss_grads(m["critics"], m["actor"], m["actor_grads"], obs, pi, logp, fwd, alpha,
                                b["actions"][:self.demo_rows(len(obs))], s.bc_coef, s.actor_q, m["bounds"],
                                None if read is None else read.set_result)

    def actor_objective(self, b: dict, pi: torch.Tensor, logp: torch.Tensor, alpha: torch.Tensor):
        """(SAC's actor loss through the critics, the BC term): with sac.bc_coef, the squared error of the actor's
        deterministic action on the minibatch's demonstration rows (its first ones) to the demonstrated action."""
        loss = actor_loss(logp, self.critic(b["obs"], pi), alpha, self.cfg.sac.actor_q)
        if not self.cfg.sac.bc_coef:
            return loss, torch.zeros(())
        k = self.demo_rows(len(pi))
        mean, _ = self.policy.dist(b["obs"][:k])
        return loss, (torch.tanh(mean) - b["actions"][:k]).pow(2).sum(-1).mean()

    def critic_objective(self, b: dict, eps: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The critics' loss against the soft TD target, and the first critic's mean Q."""
        y = self.td_target(b, eps, alpha)
        q = self.critic(b["obs"], b["actions"])
        return critic_loss(q, y), q[0].detach().mean()

    @torch.no_grad()
    def td_target(self, b: dict, eps: torch.Tensor, alpha: torch.Tensor, sample=None) -> torch.Tensor:
        """The soft TD target [B] of the target critics (all, or sac.min_qs of them drawn at random), at the actor's
        actions on the next observations: `sample` (next actions, their log pi) when taken already, else drawn here
        with the noise eps."""
        next_pi, next_logp = self.policy.sample(b["next_obs"], eps) if sample is None else sample
        n, m = self.cfg.sac.n_critics, self.cfg.sac.min_qs
        which = None if m is None or m == n else torch.randperm(n, generator=self.gen)[:m].tolist()
        return soft_td_target(b["rewards"], b["terminated"], self.target(b["next_obs"], next_pi, which), next_logp,
                              alpha, self.cfg.algorithm.gamma)

    def finite(self, c_loss: torch.Tensor) -> bool:
        """Checked before anything is stepped: a non-finite critics' loss stops the run, or drops this step."""
        if bool(torch.isfinite(c_loss)):
            return True
        culprit = "the critics' loss (a non-finite reward or observation in the buffer, or diverged critics)"
        nonfinite_update(float(c_loss.detach()), culprit, self.cfg.actor.nonfinite)
        return False

    def temperature_step(self, logp: torch.Tensor) -> None:
        if self.tuned:
            self.alpha_opt.zero_grad()
            temperature_loss(self.log_alpha, logp, self.target_entropy).backward()
            self.alpha_step()

    def manual_temperature_step(self, logp: torch.Tensor) -> None:
        if self.tuned:  # temperature_loss's gradient on log alpha
            self.log_alpha.grad = -(logp.mean() + self.target_entropy)
            self.alpha_step()

    def after_step(self, c_loss, a_loss, bc, alpha, logp, q) -> torch.Tensor:
        """After the critics stepped: move the targets -> the step's stats."""
        self.move_targets()
        return self.stats(c_loss, a_loss, bc, alpha, logp, q)

    def move_targets(self) -> None:
        """Count the step, move the target critics every target_update_interval steps."""
        self.updates += 1
        if self.updates % self.cfg.sac.target_update_interval == 0:
            polyak_update(*self._polyak_pairs, self.cfg.sac.tau)

    @staticmethod
    def stats(c_loss, a_loss, bc, alpha, logp, q) -> torch.Tensor:
        return torch.stack([c_loss.detach(), a_loss.detach(), alpha, -logp.detach().mean(), q, bc.detach()])

    def _sample(self, n: int) -> dict[str, torch.Tensor]:
        """A minibatch of n transitions: from the online buffer, or (RLPD) demo_fraction of them from the
        demonstrations and the rest from the online buffer."""
        if self.demos is None:
            return self.buffer.sample(n)
        k = self.demo_rows(n)
        demo, online = self.demos.sample(k), self.buffer.sample(n - k)
        return {key: torch.cat([demo[key], online[key]]) for key in online}

    def demo_rows(self, n: int) -> int:
        """How many of a minibatch of n rows come from the demonstrations (its first ones)."""
        return round(n * self.cfg.sac.demo_fraction)

    # -- weights and checkpoints -----------------------------------------------------------------
    def publish_weights(self, check: bool = True, local: bool = False):
        """The actor's weights (all the rollout needs), with their digest when the receivers are `check`ed."""
        return publish(self.policy.state_dict(), self.version, digest=check, local=local)

    def save_checkpoint(self, directory: str) -> None:
        """policy.safetensors (the actor: what evaluation loads), sac_critic.safetensors (critics, targets, log alpha),
        replay.safetensors (the buffer and its generator; not with sac.save_buffer=none), sac_state.pt (optimizers,
        generator, counters)."""
        from safetensors.torch import save_file

        d = Path(directory)
        save_file({k: v.contiguous() for k, v in self.policy.state_dict().items()}, str(d / "policy.safetensors"))
        nets = {**{f"critic.{k}": v for k, v in self.critic.state_dict().items()},
                **{f"target.{k}": v for k, v in self.target.state_dict().items()},
                "log_alpha": self.log_alpha.detach().clone()}
        save_file({k: v.contiguous() for k, v in nets.items()}, str(d / "sac_critic.safetensors"))
        if self.cfg.sac.save_buffer != "none":
            save_file(self.buffer.state_dict(), str(d / REPLAY_FILE))
        if self.demos is not None:  # its rows are the dataset's; its generator is what a resume needs
            save_file({"gen": self.demos.gen.get_state()}, str(d / "replay_demos.safetensors"))
        torch.save({"actor_opt": self.actor_opt.state_dict(), "critic_opt": self.critic_opt.state_dict(),
                    "alpha_opt": self.alpha_opt.state_dict() if self.alpha_opt else None, "gen": self.gen.get_state(),
                    "version": self.version, "updates": self.updates, "env_steps": self.env_steps},
                   d / "sac_state.pt")

    def load_checkpoint(self, directory: str) -> int:
        from safetensors.torch import load_file

        d = Path(directory)
        self.steps.reset()  # the optimizers' state is replaced below (sac.actor_process shares it anew)
        load_policy(self.policy, d)
        nets = load_file(str(d / "sac_critic.safetensors"))
        self.critic.load_state_dict({k[7:]: v for k, v in nets.items() if k.startswith("critic.")})
        self.target.load_state_dict({k[7:]: v for k, v in nets.items() if k.startswith("target.")})
        with torch.no_grad():
            self.log_alpha.copy_(nets["log_alpha"])
        if (d / REPLAY_FILE).exists():
            self.buffer.load_state_dict(load_file(str(d / REPLAY_FILE)))
        else:  # sac.save_buffer=none, or an older checkpoint under save_buffer=latest: refilled from here on
            print(f"m2flow: {d} holds no replay buffer ({REPLAY_FILE}; sac.save_buffer={self.cfg.sac.save_buffer}): "
                  f"the learner starts from an empty buffer and waits for sac.learning_starts env steps again",
                  file=sys.stderr, flush=True)
        if self.demos is not None and (d / "replay_demos.safetensors").exists():
            self.demos.gen.set_state(load_file(str(d / "replay_demos.safetensors"))["gen"])
        s = load_plain(d / "sac_state.pt")
        self.actor_opt.load_state_dict(s["actor_opt"])
        self.critic_opt.load_state_dict(s["critic_opt"])
        if self.alpha_opt is not None and s["alpha_opt"] is not None:
            self.alpha_opt.load_state_dict(s["alpha_opt"])
        self.gen.set_state(s["gen"])
        self.version, self.updates, self.env_steps = s["version"], s["updates"], s["env_steps"]
        return self.version
