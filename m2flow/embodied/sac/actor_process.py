"""sac.actor_process: the actor's side of `sac.parallel_update`'s pipelined step in a process of its own instead of
a thread of the learner's, so that the two sides never queue for one Python interpreter lock.

Why: each side of the step is ~130 small torch calls a gradient step, and every call gives the lock up and takes it
back. Run in two threads, each side took 30% longer than alone (A B A B, 3 each, on 2 cores: the actor's side 5.2-5.4
against 4.0-4.5 ms a step, the critics' 4.6-4.8 against 3.5-4.0 ms); in two processes each ran as fast as alone.

The learner (its side: `parallel.ActorProcessSteps`) keeps everything that owns state: the replay buffers and every
generator (so it draws each step's minibatch and noise, in the one-thread step's order), the critics, targets,
temperature and their optimizers. This process holds no state of its own: the actor's weights and Adam state and the
critics' weights are the learner's tensors, moved to shared memory, and per step it gets the minibatch and the
temperature through a ring of shared slots. The hand-offs are those of the threaded step:

    learner -> actor process: batch (the minibatch's flat observations, next observations, actions, noise),
                              ready (the critics stepped to this step's, and its temperature), go (its loss is finite)
    actor process -> learner: nxt (the next actions and their log pi), read (log pi, once the critics are read)

A ring of two slots suffices: a slot is written again two steps later, after hand-offs that follow the reader's last
use of it. The process starts at the learner's first update (a fresh interpreter, `python -c`, ~2 s; not
multiprocessing's spawn, which would run the parent's main script again) and ends with the learner, or when its
parent is gone. The shared tensors reach it as multiprocessing passes them (file descriptors, through its resource
sharer); each hand-off is a pipe, one byte a release, whose descriptors the process inherits. An error in it surfaces
from the learner's update with its traceback; an error in the learner ends it (the next update starts a new one).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import traceback
import weakref
from multiprocessing import current_process
from multiprocessing.connection import Connection
from typing import Callable

import torch
import torch.multiprocessing  # noqa: F401 - registers the pickling of tensors as shared memory

from m2flow.algorithms.sac_grad import actor_loss_grads, squashed_sample
from m2flow.engines.optim import FusedAdamStep

POLL_S = 0.25  # how often a wait checks that the other side is still alive
HANDOFFS = ("batch", "nxt", "read", "ready", "go")


class Signal:
    """A counting semaphore between two processes: a pipe, one byte a release; the child process inherits its two
    descriptors (`fds`)."""

    def __init__(self, fds: tuple[int, int] | None = None):
        self.r, self.w = fds if fds is not None else os.pipe()
        os.set_blocking(self.r, False)

    def release(self) -> None:
        os.write(self.w, b"\0")

    def acquire(self, timeout: float) -> bool:
        """Take one release, waiting up to `timeout` seconds -> whether one was taken."""
        try:
            os.read(self.r, 1)
            return True
        except BlockingIOError:
            pass
        if not select.select([self.r], [], [], timeout)[0]:
            return False
        os.read(self.r, 1)
        return True

    def fds(self) -> tuple[int, int]:
        return self.r, self.w

    def close(self) -> None:
        for fd in (self.r, self.w):
            os.close(fd)


def share(tensors) -> None:
    """Move tensors to shared memory in place (the same tensor objects, now readable by a child process)."""
    for t in tensors:
        t.share_memory_()


def adam_state(opt: torch.optim.Adam) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """opt's (step, exp_avg, exp_avg_sq) per parameter, created as its first step would (zeros) where missing."""
    out = []
    for p in opt.param_groups[0]["params"]:
        if p not in opt.state:
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
        s = opt.state[p]
        out.append((s["step"], s["exp_avg"], s["exp_avg_sq"]))
    return out


class ActorProcess:
    """The learner's handle on the actor's process: `begin` a call of n steps, the per-step hand-offs, `end`."""

    def __init__(self, manual: dict, actor_opt: torch.optim.Adam, *, batch: int, obs_dim: int, act_dim: int,
                 logp_eps: float, actor_q: str, bc_coef: float, demo_rows: int, threads: int, name: str):
        params = actor_opt.param_groups[0]["params"]
        state = adam_state(actor_opt)
        critics = [t for hidden, head in manual["critics"] for layer in [*hidden, head] for t in layer]
        share([*params, *[t for s in state for t in s], *critics])
        self.slots = {"obs": torch.zeros(2, batch, obs_dim), "next_obs": torch.zeros(2, batch, obs_dim),
                      "actions": torch.zeros(2, batch, act_dim), "eps": torch.zeros(2, 2, batch, act_dim),
                      "next_pi": torch.zeros(2, batch, act_dim), "next_logp": torch.zeros(2, batch),
                      "logp": torch.zeros(2, batch), "alpha": torch.zeros(2), "go": torch.zeros(2, dtype=torch.bool)}
        share(self.slots.values())
        self.sems = {k: Signal() for k in HANDOFFS}
        ours, theirs = os.pipe(), os.pipe()  # commands to the process, its results back
        self.cmd = Connection(ours[1], readable=False)
        self.res = Connection(theirs[0], writable=False)
        fds = [ours[0], theirs[1], *[fd for sem in self.sems.values() for fd in sem.fds()]]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from m2flow.embodied.sac.actor_process import child; "
                                   "child(*map(int, sys.argv[1:]))", str(os.getpid()), *map(str, fds)],
            pass_fds=fds, env=env)
        for fd in (ours[0], theirs[1]):
            os.close(fd)
        self._reap = weakref.finalize(self, _end, self.proc, [self.cmd, self.res, *self.sems.values()])
        g = actor_opt.param_groups[0]
        self.cmd.send_bytes(bytes(current_process().authkey))  # the resource sharer's, which hands the tensors over
        self.cmd.send({"manual": {k: manual[k] for k in ("actor", "critics", "bounds")}, "params": params,
                       "state": state, "adam": {"lr": g["lr"], "betas": g["betas"], "eps": g["eps"]},
                       "logp_eps": logp_eps, "actor_q": actor_q, "bc_coef": bc_coef, "demo_rows": demo_rows,
                       "threads": threads, "slots": self.slots})

    # -- the learner's side of the hand-offs ------------------------------------------------------------------------
    def begin(self, n: int, alpha: torch.Tensor) -> None:
        try:
            self.cmd.send(n)
        except OSError:  # the process is gone (a broken pipe): say so, as a wait would
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            self._check()
            raise
        self.ready(0, alpha)

    def batch(self, k: int, obs: torch.Tensor, next_obs: torch.Tensor, actions: torch.Tensor,
              eps: torch.Tensor) -> None:
        s = k % 2
        for key, value in (("obs", obs), ("next_obs", next_obs), ("actions", actions), ("eps", eps)):
            self.slots[key][s].copy_(value)
        self.sems["batch"].release()

    def nxt(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._wait("nxt")
        return self.slots["next_pi"][k % 2], self.slots["next_logp"][k % 2]

    def go(self, k: int, finite: bool) -> None:
        self.slots["go"][k % 2] = finite
        self.sems["go"].release()

    def read(self, k: int) -> torch.Tensor:
        self._wait("read")
        return self.slots["logp"][k % 2].clone()

    def ready(self, k: int, alpha: torch.Tensor) -> None:
        self.slots["alpha"][k % 2] = alpha
        self.sems["ready"].release()

    def end(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """After the call's last step: its (actor's loss, BC term) per step."""
        while not self.res.poll(POLL_S):
            self._check()
        status, out = self.res.recv()
        if status != "ok":
            raise RuntimeError(f"sac.actor_process: the actor's process ({self.name}) failed:\n{out}")
        return [(torch.tensor(a), torch.tensor(bc)) for a, bc in out]

    def close(self) -> None:
        self._reap()

    def _wait(self, key: str) -> None:
        while not self.sems[key].acquire(POLL_S):
            self._check()

    def _check(self) -> None:
        """Raise if the actor's process is gone (with its traceback when it sent one)."""
        if self.proc.poll() is None:
            return
        detail = f"exit code {self.proc.returncode}"
        try:
            if self.res.poll(0):
                status, out = self.res.recv()
                detail = out if status != "ok" else detail
        except EOFError:  # it sent nothing (killed)
            pass
        raise RuntimeError(f"sac.actor_process: the actor's process ({self.name}) ended during the update:\n{detail}")


def _end(proc: subprocess.Popen, ends: list) -> None:
    """Kill the actor's process (when the learner closes its handle, or drops it) and close the pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for end in ends:
        end.close()


def child(parent: int, cmd_fd: int, res_fd: int, *sem_fds: int) -> None:
    """The actor's process (`python -c`): per call of n steps, `_steps`; ends when its parent is gone."""
    cmd, res = Connection(cmd_fd, writable=False), Connection(res_fd, readable=False)
    sems = {k: Signal((sem_fds[2 * i], sem_fds[2 * i + 1])) for i, k in enumerate(HANDOFFS)}
    current_process().authkey = cmd.recv_bytes()
    spec = cmd.recv()
    torch.set_num_threads(spec["threads"])
    params, slots = spec["params"], spec["slots"]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.Adam(params, lr=spec["adam"]["lr"], betas=spec["adam"]["betas"], eps=spec["adam"]["eps"],
                           fused=True)
    for p, (step, avg, avg_sq) in zip(params, spec["state"]):
        opt.state[p] = {"step": step, "exp_avg": avg, "exp_avg_sq": avg_sq}
    step = FusedAdamStep(opt).step
    grads = {id(p): p.grad for p in params}
    actor_grads = tuple([tuple(grads[id(t)] for t in layer) for layer in part] if isinstance(part, list)
                        else tuple(grads[id(t)] for t in part) for part in spec["manual"]["actor"])

    def wait(key: str) -> None:
        while not sems[key].acquire(POLL_S):
            if os.getppid() != parent:
                raise SystemExit(0)

    while True:
        while not cmd.poll(POLL_S):
            if os.getppid() != parent:
                return
        try:
            n = cmd.recv()
        except EOFError:  # the learner closed its end: it is done, or gone
            return
        try:
            with torch.no_grad():
                out = _steps(n, spec, actor_grads, slots, sems, wait, step)
            res.send(("ok", out))
        except SystemExit:  # its parent is gone (`wait`): nothing to hand the error to
            return
        except BaseException:  # noqa: BLE001 - handed to the learner, which raises it
            res.send(("error", traceback.format_exc()))
            raise


def _steps(n: int, spec: dict, actor_grads, slots: dict, sems: dict, wait: Callable[[str], None],
           step: Callable[[], None]) -> list[list[float]]:
    """n steps of the actor's side (the thread's `parallel.ThreadedManual.actor_steps`, the minibatch drawn by the
    learner) -> each step's [actor's loss, BC term]."""
    m, out = spec["manual"], []
    for k in range(n):
        s = k % 2
        wait("batch")
        obs, eps = slots["obs"][s], slots["eps"][s]
        next_pi, next_logp = squashed_sample(*m["actor"], slots["next_obs"][s], eps[1], m["bounds"],
                                             spec["logp_eps"])[:2]
        slots["next_pi"][s].copy_(next_pi)
        slots["next_logp"][s].copy_(next_logp)
        sems["nxt"].release()
        pi, logp, fwd = squashed_sample(*m["actor"], obs, eps[0], m["bounds"], spec["logp_eps"])
        wait("ready")
        alpha = slots["alpha"][s].clone()

        def read(x: torch.Tensor, s: int = s) -> None:
            slots["logp"][s].copy_(x)
            sems["read"].release()

        loss, bc = actor_loss_grads(m["critics"], m["actor"], actor_grads, obs, pi, logp, fwd, alpha,
                                    slots["actions"][s][:spec["demo_rows"]], spec["bc_coef"], spec["actor_q"],
                                    m["bounds"], read)
        out.append([float(loss), float(bc)])
        wait("go")
        if bool(slots["go"][s]):
            step()
    return out
