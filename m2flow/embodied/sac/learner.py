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
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from m2flow.algorithms import actor_loss, critic_loss, polyak_update, soft_td_target, temperature_loss
from m2flow.algorithms.sac_grad import (actor_loss_grads, critics_forward, critics_loss_grads, mlp_layers,
                                        squashed_sample)
from m2flow.embodied.bc import demo_transitions
from m2flow.embodied.envs import Trajectory
from m2flow.embodied.policies import Critics
from m2flow.embodied.sac.actor_process import ActorProcess
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


@contextmanager
def _intra_op_threads(n: int | None):
    """torch's intra-op threads set to n (None: left alone) while the updates run, then restored: the process may
    host other workers. sac.parallel_update halves them, one half for each of its two threads."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Pipe:
    """The hand-offs of `SACLearnerWorker._manual_parallel_updates`' two threads over n steps, a future each per
    step: the pool's thread gives `batch` (minibatch, noise, flat observations), `nxt` (the next actions, their log
    pi), `read` (the actor's log pi, once the critics' weights are read) and `done` (the actor's loss, the BC term);
    the critics' thread gives `ready` (the critics stepped to the step's, and its temperature) and `go` (the
    critics' loss is finite: the step is taken)."""

    def __init__(self, n: int):
        self.n = n
        self.batch, self.nxt, self.read, self.done = ([Future() for _ in range(n)] for _ in range(4))
        self.ready, self.go = [Future() for _ in range(n)], [Future() for _ in range(n)]

    def fail(self, error: BaseException) -> None:
        """The pool's thread failed: whatever the critics' thread waits on raises its error."""
        _raise_in([*self.batch, *self.nxt, *self.read, *self.done], error)

    def cancel(self, error: BaseException) -> None:
        """The critics' thread failed: whatever the pool's thread waits on raises its error."""
        _raise_in([*self.ready, *self.go], error)


def _raise_in(futures: list[Future], error: BaseException) -> None:
    for f in futures:
        if not f.done():
            f.set_exception(error)


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
        self._actor_step, self._critic_step = FusedAdamStep(self.actor_opt).step, FusedAdamStep(self.critic_opt).step
        self._alpha_step = FusedAdamStep(self.alpha_opt).step if self.tuned else None
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
        self._pool, self._threads = None, None
        if s.parallel_update:  # two threads, each with half the learner's cores for its own ops
            self._threads = max(1, torch.get_num_threads() // 2)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="m2flow-sac-actor")
        self._manual = self._manual_networks()
        self._actor_proc: ActorProcess | None = None  # sac.actor_process: started at the first iteration
        self._polyak_pairs = (list(self.target.parameters()), list(self.critic.parameters()))  # updated in place
        self.version, self.updates, self.env_steps = 0, 0, 0

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
            if self.cfg.sac.actor_process:  # its start-up (a Python with torch) overlaps the warm-up's collection
                self._actor_process()
            return {"sac/updates": 0}
        with self.device_phase("train", step), _intra_op_threads(self._threads):
            if self.cfg.sac.actor_process:
                done = self._process_parallel_updates(n)
            elif self._manual is not None and self._pool is not None:
                done = self._manual_parallel_updates(n)
            else:
                done = [x for x in (self._update() for _ in range(n)) if x is not None]
        stats = torch.stack(done).mean(0).tolist() if done else [float("nan")] * len(STATS)
        out = {**dict(zip(STATS, stats)), "sac/updates": len(done), "actor/nonfinite_skipped": n - len(done)}
        if not self.cfg.sac.bc_coef:
            del out["sac/bc_loss"]
        return out

    def _update(self) -> torch.Tensor | None:
        """One gradient step (temperature, critics, actor, targets, in SB3's order) -> its stats; None when it was
        dropped for a non-finite loss (actor.nonfinite=skip)."""
        if self._manual is not None and self._pool is not None:
            return next(iter(self._manual_parallel_updates(1)), None)
        b, eps = self._draw()
        alpha = self.log_alpha.detach().exp()  # this step's temperature, before its own update (as SB3)
        if self._manual is not None:
            with torch.no_grad():
                return self._manual_update(b, eps, alpha)
        if self._pool is not None:
            return self._parallel_update(b, eps, alpha)
        pi, logp = self.policy.sample(b["obs"], eps[0])
        c_loss, q = self._critic_loss(b, eps[1], alpha)
        if not self._finite(c_loss):
            return None
        self._temperature_step(logp)
        self.critic_opt.zero_grad()
        c_loss.backward()
        self._critic_step()
        self.critic.requires_grad_(False)  # the actor's loss differentiates through the critics, not into them
        a_loss, bc = self._actor_objective(b, pi, logp, alpha)
        self.actor_opt.zero_grad()
        (a_loss + self.cfg.sac.bc_coef * bc).backward()
        self._actor_step()
        self.critic.requires_grad_(True)
        return self._after_step(c_loss, a_loss, bc, alpha, logp, q)

    def _parallel_update(self, b: dict, eps: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor | None:
        """sac.parallel_update: the actor's gradient in the pool's thread, through the critics as they are before
        this step, while this thread takes the critics' gradient; then the temperature, critics and actor step."""
        self.actor_opt.zero_grad()
        actor = self._pool.submit(self._actor_gradient, b, eps[0], alpha)
        c_loss, q = self._critic_loss(b, eps[1], alpha)
        self.critic_opt.zero_grad()
        c_loss.backward()
        a_loss, bc, logp = actor.result()
        if not self._finite(c_loss):
            return None
        self._temperature_step(logp)
        self._critic_step()
        self._actor_step()
        return self._after_step(c_loss, a_loss, bc, alpha, logp, q)

    def _manual_update(self, b: dict, eps: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor | None:
        """sac.grad=manual: `_update`'s step with the gradients written out (m2flow.algorithms.sac_grad) into the
        parameters' kept `.grad` tensors; under no_grad."""
        m, obs = self._manual, b["obs"].float().flatten(1)
        pi, logp, fwd = squashed_sample(*m["actor"], obs, eps[0], m["bounds"], self.policy.logp_eps)
        target = self._td_target(b, eps[1], alpha)
        c_loss, q = critics_loss_grads(m["critics"], torch.cat([obs, b["actions"]], 1), target, m["critic_grads"])
        if not self._finite(c_loss):
            return None
        self._manual_temperature_step(logp)
        self._critic_step()
        # SB3's order: the actor's gradient through the critics just stepped
        a_loss, bc = self._manual_actor_grads(b, obs, pi, logp, fwd, alpha)
        self._actor_step()
        return self._after_step(c_loss, a_loss, bc, alpha, logp, q[0].mean())

    def _draw(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A step's minibatch and its reparameterization noise [2, B, action] (the actor's, the next actions')."""
        n = self.cfg.sac.batch_size
        return self._sample(n), torch.randn((2, n, *self.policy.mu.bias.shape), generator=self.gen)

    def _manual_parallel_updates(self, n: int) -> list[torch.Tensor]:
        """n of sac.parallel_update's steps under sac.grad=manual, pipelined over two threads -> the stats of those
        not dropped. The pool's thread (`_manual_actor_steps`) draws each step's minibatch and noise, samples the next
        observations' actions, and takes the actor's gradient through the critics as they are before the step. This
        thread takes the critics' gradient on the TD target of those actions; once it found their loss finite and
        the other thread is done reading the critics' weights, it steps the temperature, the critics and the targets,
        while the other steps the actor and starts on the next step's minibatch. Every generator is drawn from in the
        one-thread step's order."""
        m, pipe = self._manual, _Pipe(n)
        alpha = self.log_alpha.detach().exp()
        pipe.ready[0].set_result(alpha)
        job = self._pool.submit(self._manual_actor_steps, pipe)
        taken = []  # (step, its critics' loss, alpha, log pi, first critic's mean Q) of the steps not dropped
        try:
            with torch.no_grad():
                for k in range(n):
                    b, eps, obs = pipe.batch[k].result()
                    x = torch.cat([obs, b["actions"]], 1)
                    runs = critics_forward(m["critics"], x)  # while the next actions are sampled
                    target = self._td_target(b, eps[1], alpha, pipe.nxt[k].result())
                    c_loss, q = critics_loss_grads(m["critics"], x, target, m["critic_grads"], runs)
                    finite = self._finite(c_loss)
                    pipe.go[k].set_result(finite)
                    if finite:  # once the other thread is done with the critics' weights
                        alpha = self._step_critics(k, c_loss, alpha, pipe.read[k].result(), q, taken)
                    if k + 1 < n:
                        pipe.ready[k + 1].set_result(alpha)
        except BaseException as e:
            pipe.cancel(e)  # the other thread's own error first, when it had one; never left running
            error = job.exception()
            raise error if error is not None and error is not e else e
        job.result()
        return [self._stats(c, *pipe.done[k].result(), a, logp, q) for k, c, a, logp, q in taken]

    def _process_parallel_updates(self, n: int) -> list[torch.Tensor]:
        """`_manual_parallel_updates` with the actor's side in its own process (sac.actor_process: m2flow.embodied.sac.
        actor_process), which this side hands each step's minibatch and noise: drawn here, in the same order."""
        m, p = self._manual, self._actor_process()
        alpha = self.log_alpha.detach().exp()
        taken = []  # (step, its critics' loss, alpha, log pi, first critic's mean Q) of the steps not dropped
        try:
            p.begin(n, alpha)
            with torch.no_grad():
                b, eps = self._draw()
                obs = b["obs"].float().flatten(1)
                p.batch(0, obs, b["next_obs"].float().flatten(1), b["actions"], eps)
                for k in range(n):
                    x = torch.cat([obs, b["actions"]], 1)
                    runs = critics_forward(m["critics"], x)  # while the next actions are sampled
                    target = self._td_target(b, eps[1], alpha, p.nxt(k))
                    c_loss, q = critics_loss_grads(m["critics"], x, target, m["critic_grads"], runs)
                    finite = self._finite(c_loss)
                    p.go(k, finite)
                    if k + 1 < n:  # the next step's draws, after this step's (the TD target's sac.min_qs)
                        b, eps = self._draw()
                        obs = b["obs"].float().flatten(1)
                        p.batch(k + 1, obs, b["next_obs"].float().flatten(1), b["actions"], eps)
                    if finite:  # once the other process is done with the critics' weights
                        alpha = self._step_critics(k, c_loss, alpha, p.read(k), q, taken)
                    if k + 1 < n:
                        p.ready(k + 1, alpha)
            actor = p.end()
        except BaseException:
            self._close_actor_process()  # never left mid-call: the next update starts a new one
            raise
        return [self._stats(c, *actor[k], a, logp, q) for k, c, a, logp, q in taken]

    def _step_critics(self, k: int, c_loss, alpha, logp, q, taken: list) -> torch.Tensor:
        """The critics' side's end of pipelined step k (its loss finite, the actor's side done reading the critics):
        the temperature, critics and targets step, and the step goes into `taken` -> the next step's temperature."""
        self._manual_temperature_step(logp)
        self._critic_step()
        self._move_targets()
        taken.append((k, c_loss, alpha, logp, q[0].mean()))
        return self.log_alpha.detach().exp()

    def _actor_process(self) -> ActorProcess:
        """The actor's process (sac.actor_process), started on the learner's weights and Adam state when there is
        none: at the first iteration, or the first after a checkpoint was loaded or the process failed."""
        if self._actor_proc is None:
            s = self.cfg.sac
            self._actor_proc = ActorProcess(
                self._manual, self.actor_opt, batch=s.batch_size, obs_dim=self.policy.obs_dim,
                act_dim=math.prod(self.policy.act_shape), logp_eps=self.policy.logp_eps, actor_q=s.actor_q,
                bc_coef=s.bc_coef, demo_rows=self._demo_rows(s.batch_size), threads=self._threads,
                name=f"m2flow-sac-actor-{os.getpid()}")
        return self._actor_proc

    def _close_actor_process(self) -> None:
        if self._actor_proc is not None:
            self._actor_proc.close()
            self._actor_proc = None

    def _manual_actor_steps(self, pipe: "_Pipe") -> None:
        """sac.parallel_update's pool thread under sac.grad=manual, for `_manual_parallel_updates`: per step, the
        minibatch and noise, the next observations' actions and their log pi, the actor's gradient (its log pi handed
        over once the critics' weights are read), the actor's step when the critics' loss was finite, then the next
        step's minibatch."""
        torch.set_num_threads(self._threads)  # this thread's own OpenMP team, which need not follow the other's
        actor, bounds, logp_eps = self._manual["actor"], self._manual["bounds"], self.policy.logp_eps
        try:
            with torch.no_grad():
                b, eps = self._draw()
                for k in range(pipe.n):
                    obs = b["obs"].float().flatten(1)
                    pipe.batch[k].set_result((b, eps, obs))
                    pipe.nxt[k].set_result(squashed_sample(*actor, b["next_obs"].float().flatten(1), eps[1], bounds,
                                                           logp_eps)[:2])
                    pi, logp, fwd = squashed_sample(*actor, obs, eps[0], bounds, logp_eps)
                    alpha = pipe.ready[k].result()  # the critics as this step reads them, and its temperature
                    pipe.done[k].set_result(self._manual_actor_grads(b, obs, pi, logp, fwd, alpha, pipe.read[k]))
                    if pipe.go[k].result():  # the other thread drew this step's last numbers (sac.min_qs) by now
                        self._actor_step()
                    if k + 1 < pipe.n:
                        b, eps = self._draw()
        except BaseException as e:  # nothing left waiting on what this thread never gave
            pipe.fail(e)
            raise

    def _manual_actor_grads(self, b: dict, obs, pi, logp, fwd, alpha, read: Future | None = None):
        """The actor's loss (actor_loss, and `_actor_objective`'s BC term with sac.bc_coef) and its gradient into
        the actor's `.grad`s -> (the loss, the BC term). `read`: given log pi once the critics' weights are no
        longer read."""
        m, s = self._manual, self.cfg.sac
        return actor_loss_grads(m["critics"], m["actor"], m["actor_grads"], obs, pi, logp, fwd, alpha,
                                b["actions"][:self._demo_rows(len(obs))], s.bc_coef, s.actor_q, m["bounds"],
                                None if read is None else read.set_result)

    def _actor_gradient(self, b: dict, eps: torch.Tensor, alpha: torch.Tensor):
        """The actor's loss and its gradient into the actor's weights only (`inputs=`: the critics' weights get
        none, and are neither written nor differentiated, so the other thread's critic step is untouched)."""
        torch.set_num_threads(self._threads)  # this thread's own OpenMP team, which need not follow the other's
        pi, logp = self.policy.sample(b["obs"], eps)
        loss, bc = self._actor_objective(b, pi, logp, alpha)
        torch.autograd.backward(loss + self.cfg.sac.bc_coef * bc, inputs=list(self.policy.parameters()))
        return loss.detach(), bc.detach(), logp.detach()

    def _actor_objective(self, b: dict, pi: torch.Tensor, logp: torch.Tensor, alpha: torch.Tensor):
        """(SAC's actor loss through the critics, the BC term): with sac.bc_coef, the squared error of the actor's
        deterministic action on the minibatch's demonstration rows (its first ones) to the demonstrated action."""
        loss = actor_loss(logp, self.critic(b["obs"], pi), alpha, self.cfg.sac.actor_q)
        if not self.cfg.sac.bc_coef:
            return loss, torch.zeros(())
        k = self._demo_rows(len(pi))
        mean, _ = self.policy.dist(b["obs"][:k])
        return loss, (torch.tanh(mean) - b["actions"][:k]).pow(2).sum(-1).mean()

    def _critic_loss(self, b: dict, eps: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The critics' loss against the soft TD target, and the first critic's mean Q."""
        y = self._td_target(b, eps, alpha)
        q = self.critic(b["obs"], b["actions"])
        return critic_loss(q, y), q[0].detach().mean()

    @torch.no_grad()
    def _td_target(self, b: dict, eps: torch.Tensor, alpha: torch.Tensor, sample=None) -> torch.Tensor:
        """The soft TD target [B] of the target critics (all, or sac.min_qs of them drawn at random), at the actor's
        actions on the next observations: `sample` (next actions, their log pi) when taken already, else drawn here
        with the noise eps."""
        next_pi, next_logp = self.policy.sample(b["next_obs"], eps) if sample is None else sample
        n, m = self.cfg.sac.n_critics, self.cfg.sac.min_qs
        which = None if m is None or m == n else torch.randperm(n, generator=self.gen)[:m].tolist()
        return soft_td_target(b["rewards"], b["terminated"], self.target(b["next_obs"], next_pi, which), next_logp,
                              alpha, self.cfg.algorithm.gamma)

    def _finite(self, c_loss: torch.Tensor) -> bool:
        """Checked before anything is stepped: a non-finite critics' loss stops the run, or drops this step."""
        if bool(torch.isfinite(c_loss)):
            return True
        culprit = "the critics' loss (a non-finite reward or observation in the buffer, or diverged critics)"
        nonfinite_update(float(c_loss.detach()), culprit, self.cfg.actor.nonfinite)
        return False

    def _temperature_step(self, logp: torch.Tensor) -> None:
        if self.tuned:
            self.alpha_opt.zero_grad()
            temperature_loss(self.log_alpha, logp, self.target_entropy).backward()
            self._alpha_step()

    def _manual_temperature_step(self, logp: torch.Tensor) -> None:
        if self.tuned:  # temperature_loss's gradient on log alpha
            self.log_alpha.grad = -(logp.mean() + self.target_entropy)
            self._alpha_step()

    def _after_step(self, c_loss, a_loss, bc, alpha, logp, q) -> torch.Tensor:
        """After the critics stepped: move the targets -> the step's stats."""
        self._move_targets()
        return self._stats(c_loss, a_loss, bc, alpha, logp, q)

    def _move_targets(self) -> None:
        """Count the step, move the target critics every target_update_interval steps."""
        self.updates += 1
        if self.updates % self.cfg.sac.target_update_interval == 0:
            polyak_update(*self._polyak_pairs, self.cfg.sac.tau)

    @staticmethod
    def _stats(c_loss, a_loss, bc, alpha, logp, q) -> torch.Tensor:
        return torch.stack([c_loss.detach(), a_loss.detach(), alpha, -logp.detach().mean(), q, bc.detach()])

    def _sample(self, n: int) -> dict[str, torch.Tensor]:
        """A minibatch of n transitions: from the online buffer, or (RLPD) demo_fraction of them from the
        demonstrations and the rest from the online buffer."""
        if self.demos is None:
            return self.buffer.sample(n)
        k = self._demo_rows(n)
        demo, online = self.demos.sample(k), self.buffer.sample(n - k)
        return {key: torch.cat([demo[key], online[key]]) for key in online}

    def _demo_rows(self, n: int) -> int:
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
        self._close_actor_process()  # the optimizers' state is replaced below: shared anew at the next update
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
