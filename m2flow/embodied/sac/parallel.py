"""sac.parallel_update: an opt-in speed-up of the SAC learner's gradient steps (m2flow.embodied.sac.learner), with
the learner's own numbers kept where the ops are the same (tests/unit/test_sac_parts.py holds each to its reference).

A step has two sides that need not wait for each other: the critics' (the TD target, the critics' loss and gradient,
the temperature's, the critics' and the targets' steps) and the actor's (its loss through the critics as they are
before this step, as the original SAC implementation orders it, its gradient and its step). Here they run at once,
each side with half the learner's cores:

- `ThreadedAutograd`: by autograd, the actor's side in a second thread (sac.grad=autograd);
- `ThreadedManual`: by the hand-written gradients (sac.grad=manual, m2flow.algorithms.sac_grad), pipelined: the
  second thread draws the next step's minibatch and samples its next actions while this one steps the critics;
- `ActorProcessSteps`: `ThreadedManual` with the actor's side in a process of its own (sac.actor_process,
  m2flow.embodied.sac.actor_process), so that the two sides never queue for one interpreter lock.

Each takes the interface of `learner.SerialSteps` (`run`, `warm_up`, `reset`); `parallel_steps` picks one from the
config. Every generator is drawn from in the order of the learner's one-thread step.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from m2flow.algorithms.sac_grad import critics_forward, critics_loss_grads, squashed_sample
from m2flow.embodied.sac.actor_process import ActorProcess


def parallel_steps(learner):
    """The speed-up sac.parallel_update runs for `learner` (a SACLearnerWorker): in a process with
    sac.actor_process, by the hand-written gradients where the learner has them, else by autograd."""
    if learner.cfg.sac.actor_process:
        return ActorProcessSteps(learner)
    return ThreadedManual(learner) if learner.manual is not None else ThreadedAutograd(learner)


@contextmanager
def _intra_op_threads(n: int):
    """torch's intra-op threads set to n while the updates run, then restored: the process may host other
    workers."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _TwoSides:
    """What the speed-ups share: the learner, and half its cores for each side of a step."""

    def __init__(self, learner):
        self.learner = learner
        self.threads = max(1, torch.get_num_threads() // 2)

    def run(self, n: int) -> list[torch.Tensor]:
        """n gradient steps -> the stats of those not dropped (a non-finite critics' loss: actor.nonfinite=skip)."""
        with _intra_op_threads(self.threads):
            return self._steps(n)

    def warm_up(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def _steps(self, n: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def _step_critics(self, k: int, c_loss, alpha, logp, q, taken: list) -> torch.Tensor:
        """The critics' side's end of pipelined step k (its loss finite, the actor's side done reading the critics):
        the temperature, critics and targets step, and the step goes into `taken` -> the next step's temperature."""
        learner = self.learner
        learner.manual_temperature_step(logp)
        learner.critic_step()
        learner.move_targets()
        taken.append((k, c_loss, alpha, logp, q[0].mean()))
        return learner.log_alpha.detach().exp()


class ThreadedAutograd(_TwoSides):
    """Each step: the actor's gradient in the pool's thread, through the critics as they are before this step, while
    this thread takes the critics' gradient; then the temperature, critics and actor step."""

    def __init__(self, learner):
        super().__init__(learner)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="m2flow-sac-actor")

    def _steps(self, n: int) -> list[torch.Tensor]:
        return [x for x in (self._step() for _ in range(n)) if x is not None]

    def _step(self) -> torch.Tensor | None:
        learner = self.learner
        b, eps = learner.draw()
        alpha = learner.log_alpha.detach().exp()
        learner.actor_opt.zero_grad()
        actor = self.pool.submit(self.actor_gradient, b, eps[0], alpha)
        c_loss, q = learner.critic_objective(b, eps[1], alpha)
        learner.critic_opt.zero_grad()
        c_loss.backward()
        a_loss, bc, logp = actor.result()
        if not learner.finite(c_loss):
            return None
        learner.temperature_step(logp)
        learner.critic_step()
        learner.actor_step()
        return learner.after_step(c_loss, a_loss, bc, alpha, logp, q)

    def actor_gradient(self, b: dict, eps: torch.Tensor, alpha: torch.Tensor):
        """The actor's loss and its gradient into the actor's weights only (`inputs=`: the critics' weights get
        none, and are neither written nor differentiated, so the other thread's critic step is untouched)."""
        torch.set_num_threads(self.threads)  # this thread's own OpenMP team, which need not follow the other's
        learner = self.learner
        pi, logp = learner.policy.sample(b["obs"], eps)
        loss, bc = learner.actor_objective(b, pi, logp, alpha)
        torch.autograd.backward(loss + learner.cfg.sac.bc_coef * bc, inputs=list(learner.policy.parameters()))
        return loss.detach(), bc.detach(), logp.detach()


class _Pipe:
    """The hand-offs of `ThreadedManual`'s two threads over n steps, a future each per step: the pool's thread gives
    `batch` (minibatch, noise, flat observations), `nxt` (the next actions, their log pi), `read` (the actor's log
    pi, once the critics' weights are read) and `done` (the actor's loss, the BC term); the critics' thread gives
    `ready` (the critics stepped to the step's, and its temperature) and `go` (the critics' loss is finite: the step
    is taken)."""

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


class ThreadedManual(_TwoSides):
    """n steps under sac.grad=manual, pipelined over two threads. The pool's thread (`actor_steps`) draws each step's
    minibatch and noise, samples the next observations' actions, and takes the actor's gradient through the critics
    as they are before the step. This thread takes the critics' gradient on the TD target of those actions; once it
    found their loss finite and the other thread is done reading the critics' weights, it steps the temperature, the
    critics and the targets, while the other steps the actor and starts on the next step's minibatch."""

    def __init__(self, learner):
        super().__init__(learner)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="m2flow-sac-actor")

    def _steps(self, n: int) -> list[torch.Tensor]:
        learner, pipe = self.learner, _Pipe(n)
        m = learner.manual
        alpha = learner.log_alpha.detach().exp()
        pipe.ready[0].set_result(alpha)
        job = self.pool.submit(self.actor_steps, pipe)
        taken = []  # (step, its critics' loss, alpha, log pi, first critic's mean Q) of the steps not dropped
        try:
            with torch.no_grad():
                for k in range(n):
                    b, eps, obs = pipe.batch[k].result()
                    x = torch.cat([obs, b["actions"]], 1)
                    runs = critics_forward(m["critics"], x)  # while the next actions are sampled
                    target = learner.td_target(b, eps[1], alpha, pipe.nxt[k].result())
                    c_loss, q = critics_loss_grads(m["critics"], x, target, m["critic_grads"], runs)
                    finite = learner.finite(c_loss)
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
        return [learner.stats(c, *pipe.done[k].result(), a, logp, q) for k, c, a, logp, q in taken]

    def actor_steps(self, pipe: _Pipe) -> None:
        """The pool's thread: per step, the minibatch and noise, the next observations' actions and their log pi,
        the actor's gradient (its log pi handed over once the critics' weights are read), the actor's step when the
        critics' loss was finite, then the next step's minibatch."""
        torch.set_num_threads(self.threads)  # this thread's own OpenMP team, which need not follow the other's
        learner = self.learner
        actor, bounds, logp_eps = learner.manual["actor"], learner.manual["bounds"], learner.policy.logp_eps
        try:
            with torch.no_grad():
                b, eps = learner.draw()
                for k in range(pipe.n):
                    obs = b["obs"].float().flatten(1)
                    pipe.batch[k].set_result((b, eps, obs))
                    pipe.nxt[k].set_result(squashed_sample(*actor, b["next_obs"].float().flatten(1), eps[1], bounds,
                                                           logp_eps)[:2])
                    pi, logp, fwd = squashed_sample(*actor, obs, eps[0], bounds, logp_eps)
                    alpha = pipe.ready[k].result()  # the critics as this step reads them, and its temperature
                    pipe.done[k].set_result(learner.manual_actor_grads(b, obs, pi, logp, fwd, alpha, pipe.read[k]))
                    if pipe.go[k].result():  # the other thread drew this step's last numbers (sac.min_qs) by now
                        learner.actor_step()
                    if k + 1 < pipe.n:
                        b, eps = learner.draw()
        except BaseException as e:  # nothing left waiting on what this thread never gave
            pipe.fail(e)
            raise


class ActorProcessSteps(_TwoSides):
    """`ThreadedManual` with the actor's side in its own process (m2flow.embodied.sac.actor_process), which this side
    hands each step's minibatch and noise: drawn here, in the same order. The process starts in the warm-up (its
    start-up, a Python with torch, overlaps the collection) and anew after a checkpoint was loaded or it failed."""

    def __init__(self, learner):
        super().__init__(learner)
        self.process: ActorProcess | None = None

    def warm_up(self) -> None:
        self._process()

    def reset(self) -> None:
        """End the process (it holds the learner's optimizer state, about to be replaced): the next call starts one."""
        if self.process is not None:
            self.process.close()
            self.process = None

    def _process(self) -> ActorProcess:
        if self.process is None:
            learner = self.learner
            s = learner.cfg.sac
            self.process = ActorProcess(
                learner.manual, learner.actor_opt, batch=s.batch_size, obs_dim=learner.policy.obs_dim,
                act_dim=math.prod(learner.policy.act_shape), logp_eps=learner.policy.logp_eps, actor_q=s.actor_q,
                bc_coef=s.bc_coef, demo_rows=learner.demo_rows(s.batch_size), threads=self.threads,
                name=f"m2flow-sac-actor-{os.getpid()}")
        return self.process

    def _steps(self, n: int) -> list[torch.Tensor]:
        learner, p = self.learner, self._process()
        m = learner.manual
        alpha = learner.log_alpha.detach().exp()
        taken = []  # (step, its critics' loss, alpha, log pi, first critic's mean Q) of the steps not dropped
        try:
            p.begin(n, alpha)
            with torch.no_grad():
                b, eps = learner.draw()
                obs = b["obs"].float().flatten(1)
                p.batch(0, obs, b["next_obs"].float().flatten(1), b["actions"], eps)
                for k in range(n):
                    x = torch.cat([obs, b["actions"]], 1)
                    runs = critics_forward(m["critics"], x)  # while the next actions are sampled
                    target = learner.td_target(b, eps[1], alpha, p.nxt(k))
                    c_loss, q = critics_loss_grads(m["critics"], x, target, m["critic_grads"], runs)
                    finite = learner.finite(c_loss)
                    p.go(k, finite)
                    if k + 1 < n:  # the next step's draws, after this step's (the TD target's sac.min_qs)
                        b, eps = learner.draw()
                        obs = b["obs"].float().flatten(1)
                        p.batch(k + 1, obs, b["next_obs"].float().flatten(1), b["actions"], eps)
                    if finite:  # once the other process is done with the critics' weights
                        alpha = self._step_critics(k, c_loss, alpha, p.read(k), q, taken)
                    if k + 1 < n:
                        p.ready(k + 1, alpha)
            actor = p.end()
        except BaseException:
            self.reset()  # never left mid-call: the next update starts a new one
            raise
        return [learner.stats(c, *actor[k], a, logp, q) for k, c, a, logp, q in taken]
