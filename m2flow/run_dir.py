"""A run on disk (docs/architecture.md): resolved config, metrics.jsonl, TensorBoard, PNG curves, atomic
checkpoints, trace. Flows call it; it never trains or schedules anything.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from m2flow import config as C
from m2flow.runtime.tracer import busy_seconds


_HELD: dict[Path, int] = {}  # run directories this process has claimed -> the descriptor holding the lock file


def claim_run_dir(path: str | Path, resume: bool = False, overwrite: bool = False) -> bool:
    """Take `path` for one run of this process: an exclusive lock on `path/.lock` (released with the process, so a
    crash leaves nothing to clean), then the rule for a directory that already holds a run (metrics or checkpoints):
    `resume` continues it, `overwrite` removes everything in it first, otherwise it is refused, naming both ways on.
    Returns False when this process holds it already (the API claims it before planning, the flow again)."""
    path = Path(path).resolve()
    if path in _HELD:
        return False
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise C.UserError(f"run directory {path} cannot be written ({e.strerror}); choose another run.dir or "
                          f"run.name") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise C.UserError(f"run directory {path} is in use by another run (pid {other}); wait for it to end, or "
                          f"give this run another run.name") from None
    try:
        held = holds_run(path)
        if held and not resume and not overwrite:
            raise C.UserError(f"run directory {path} already holds a run ({held}); continue it with run.resume=true, "
                              f"or start over with another run.name, or with run.overwrite=true (removes the old run, "
                              f"whole)")
        if overwrite:
            for child in path.iterdir():
                if child.name != ".lock":
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except BaseException:
        os.close(fd)  # drops the lock
        raise
    _HELD[path] = fd
    return True


def release_run_dir(path: str | Path) -> None:
    """Give up this process's claim on `path` (a no-op if it holds none)."""
    fd = _HELD.pop(Path(path).resolve(), None)
    if fd is not None:
        os.close(fd)


@contextmanager
def run_dir_claimed(path: str | Path, resume: bool = False, overwrite: bool = False):
    """`claim_run_dir` for the block: what runs before a flow (warm start, profiling) and the flow itself."""
    took = claim_run_dir(path, resume, overwrite)
    try:
        yield Path(path).resolve()
    finally:
        if took:
            release_run_dir(path)


def holds_run(path: str | Path) -> str:
    """What of a run `path` holds, in words ("metrics.jsonl, 2 checkpoints"), or "" if none."""
    path = Path(path)
    parts = []
    metrics = path / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_size > 0:
        parts.append("metrics.jsonl")
    ckpts = [p for p in (path / "checkpoints").glob("step_*")] if (path / "checkpoints").is_dir() else []
    if ckpts:
        parts.append(f"{len(ckpts)} checkpoint{'s' if len(ckpts) > 1 else ''}")
    return ", ".join(parts)


class RunDir:
    """`runs/NAME/`: a run's outputs. `resume=False` starts fresh files; `resume=True` keeps them. A flow opens it
    inside `run_dir_claimed`, which decides whether the directory may be used at all."""

    def __init__(self, path: str | Path, cfg, resume: bool = False):
        self.path = Path(path).resolve()  # absolute: worker processes do not share the driver's working directory
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "checkpoints").mkdir(exist_ok=True)  # plots/ comes with the first PNG (run.plots)
        C.save_yaml(cfg, self.path / "config.yaml")
        self.metrics_path = self.path / "metrics.jsonl"
        if not resume and self.metrics_path.exists():
            self.metrics_path.unlink()
        self._tb = None

    # -- metrics -------------------------------------------------------------------------------
    def _disk_full(self, err: BaseException, what: str) -> C.UserError | None:
        """The error to raise instead of `err` when writing `what` failed because the run's disk is full: errno
        ENOSPC anywhere in its chain or its text (a worker's error arrives as text), or under 1 MiB left on the
        disk (torch's writer says only 'unexpected pos'). None: some other failure."""
        chain, e = [], err
        while e is not None and len(chain) < 8:
            chain.append(e)
            e = e.__cause__ or e.__context__
        full = any(getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e) for e in chain)
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            free = -1
        if not full and not 0 <= free < 1 << 20:
            return None
        found = self.latest_checkpoint()
        kept = f"the newest complete checkpoint, step_{found[0]}, is kept" if found else "no checkpoint was written yet"
        return C.UserError(f"{what}: no space left on the disk holding {self.path} ({free:,} bytes free); {kept}: "
                           f"free some space, then run the same command with run.resume=true")

    def log(self, step: int, metrics: dict) -> None:
        """Append one line to metrics.jsonl and the finite scalars to TensorBoard (a full disk: a UserError)."""
        try:
            self._log(step, metrics)
        except OSError as err:
            raise self._disk_full(err, f"step {step}'s metrics") or err

    def _log(self, step: int, metrics: dict) -> None:
        """Append one line to metrics.jsonl and the finite scalars to TensorBoard, as one event: a summary per
        scalar (SummaryWriter.add_scalar) costs ~0.1 ms each, 3 ms a step for 30 metrics, 2% of a CartPole step."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in row.items()
                  if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)]
        self.tensorboard().add_summary(Summary(value=values), step)
        self._tb.flush()

    def tensorboard(self):
        """The event file writer of `tb/` (torch's FileWriter, which SummaryWriter wraps)."""
        if self._tb is None:
            from torch.utils.tensorboard.writer import FileWriter

            self._tb = FileWriter(str(self.path / "tb"))
        return self._tb

    def metrics(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def drop_metrics_after(self, step: int) -> None:
        """On resume from the checkpoint of step `step`: forget rows of later steps, which will be redone."""
        rows = [r for r in self.metrics() if r["step"] <= step]
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def plot(self, groups: dict[str, list[str]]) -> list[Path]:
        """One PNG per group of metric keys, e.g. {"reward": ["reward/mean", "reward/accuracy"]}."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows, out = self.metrics(), []
        for title, keys in groups.items():
            fig, ax = plt.subplots(figsize=(6, 3.5))
            drawn = False
            for key in keys:
                pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
                if pts:
                    ax.plot(*zip(*pts), marker=".", label=key)
                    drawn = True
            if not drawn:
                plt.close(fig)
                continue
            ax.set_xlabel("step")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = self.path / "plots" / f"{title.replace('/', '_')}.png"
            path.parent.mkdir(exist_ok=True)
            fig.savefig(path, dpi=100)
            plt.close(fig)
            out.append(path)
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    # When one writer of a checkpoint fails (a full disk), how long the others get to stop before its folder is
    # removed: a rank still writing would leave a partial step_N.tmp behind.
    WRITERS_DRAIN_S = 120.0

    def save_checkpoint(self, step: int, write: Callable[[Path], None]) -> Path:
        """`write(tmp_dir)` fills a temporary folder, renamed to checkpoints/step_N at once when complete,
        so a crash never leaves a half-written checkpoint that resume would pick."""
        final = self.path / "checkpoints" / f"step_{step}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            write(tmp)
            (tmp / "COMPLETE").write_text(str(step))
        except Exception as err:
            full = self._disk_full(err, f"checkpoint step_{step}")
            shutil.rmtree(tmp, ignore_errors=True)  # never loaded; on a full disk its space is wanted back
            if full:
                raise full from err
            raise
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final

    def remove_from_older_checkpoints(self, name: str, step: int) -> None:
        """Remove file `name` from every complete checkpoint before step `step`, once step's is complete: for what
        only the newest checkpoint needs to hold (SAC's replay buffer, sac.save_buffer=latest)."""
        for n, ckpt in complete_checkpoints(self.path):
            if n < step:
                (ckpt / name).unlink(missing_ok=True)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        """(step, path) of the newest complete checkpoint, or None."""
        return latest_checkpoint(self.path)

    def close(self) -> None:
        """Close the TensorBoard writer; never raises (a full disk must not hide the error that stopped the run)."""
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError:
                pass
            self._tb = None


def complete_checkpoints(run_path: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `run_path`/checkpoints (a step_N folder holding COMPLETE)."""
    return [(int(p.name[5:]), p) for p in (Path(run_path) / "checkpoints").glob("step_*")
            if p.is_dir() and p.name[5:].isdigit() and (p / "COMPLETE").exists()]


def latest_checkpoint(run_path: str | Path) -> tuple[int, Path] | None:
    """(step, path) of the newest complete checkpoint under `run_path`/checkpoints, or None."""
    found = complete_checkpoints(run_path)
    return max(found) if found else None


def _plain(v):
    try:
        return v.item()  # 0-dim tensors / numpy scalars
    except AttributeError:
        return v


def progress(enabled: bool = True):
    """A rich progress bar on stderr (a no-op object when disabled). Where stderr is no terminal (a log file), rich
    would draw nothing until the end: a plain line at each tenth of a task is printed there instead."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    class LogLines(Progress):
        """`Progress` whose updates print `description: done/total (elapsed) info` at each tenth of a task."""

        def __init__(self, *columns):
            super().__init__(*columns, disable=True)
            self.tenths: dict = {}

        def update(self, task_id, **kwargs) -> None:
            super().update(task_id, **kwargs)
            task = self._tasks[task_id]
            tenth = int(10 * task.completed // task.total) if task.total else -1
            if tenth > self.tenths.get(task_id, -1):  # the first update prints: the task has started
                self.tenths[task_id] = tenth
                line = f"{task.description}: {task.completed:g}/{task.total:g} ({task.elapsed or 0:.0f} s) " \
                       f"{task.fields.get('info', '')}"
                print(line.rstrip(), file=sys.stderr, flush=True)

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
    if enabled and not sys.stderr.isatty():
        return LogLines(*columns)
    return Progress(*columns, disable=not enabled, transient=False, console=Console(stderr=True))


def idle_metrics(spans: list[dict], start: float, end: float, devices) -> dict:
    """`time/idle/device{d}`: seconds of the step's window [start, end] (epoch seconds) in which no span ran on device
    d (wall time minus the union of its spans); `time/idle_fraction`: their mean share of the window."""
    wall = max(end - start, 1e-9)
    idle = {d: wall - b for d, b in busy_seconds(spans, start, end, devices).items()}
    out = {f"time/idle/device{d}": s for d, s in idle.items()}
    out["time/idle_fraction"] = sum(idle.values()) / (wall * max(len(idle), 1))
    return out


def offload_metrics(spans: list[dict]) -> dict:
    """Context switching in a step: `offload/seconds`, the time its spans spent moving state off and onto devices,
    and `offload/onloads`, how many turns brought state back. (The flow adds `offload/state_bytes`, the switched
    components' state, and `offload/resident_bytes`, how much of it is on the devices between steps.)"""
    moves = [s for s in spans if s.get("phase") in ("offload", "onload")]
    return {"offload/seconds": sum(s["end"] - s["start"] for s in moves),
            "offload/onloads": sum(s["phase"] == "onload" for s in moves)}

