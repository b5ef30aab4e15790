"""The run object: what a flow's driver hands off so that its loop holds the algorithm only. Built once from the
config and the plan, it owns the run directory (config.yaml, metrics, TensorBoard, plots, checkpoints: `RunDir`),
plan.yaml, where a resume starts, the progress bar, each step's clock, spans, idle and offload metrics, the trace,
held-back evaluation rows and the checkpoint cadence. It starts and trains nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import yaml

from m2flow.run_dir import RunDir, idle_metrics, offload_metrics, progress
from m2flow.runtime.group import gather_spans, wait_all
from m2flow.runtime.tracer import plot_timeline, write_chrome_trace


class Run:
    """`Run(cfg, plan, plots, label, clock)`: `plots` the metric groups drawn at the end, `label` the progress bar's,
    `clock` the metric a step's seconds go to (time/step, time/iteration)."""

    def __init__(self, cfg, plan, plots: dict[str, list[str]], label: str, clock: str = "time/step"):
        self.cfg, self.plan, self.plots, self.label, self.clock = cfg, plan, plots, label, clock
        self.dir = RunDir(cfg.run.path, cfg, resume=cfg.run.resume)
        self.path = self.dir.path
        self.groups: list = []
        self.switched: list = []
        self.state_bytes, self.each_step, self.zoom = 0, False, ()
        self.trace: list[dict] = []
        self.counters: list[dict] = []
        self._held: tuple | None = None
        self._t0 = self._w0 = 0.0
        self.start = 0

    def write_plan(self, **extra) -> None:
        """plan.yaml: the plan, and what the flow decided from it (`extra`)."""
        (self.path / "plan.yaml").write_text(yaml.safe_dump({**self.plan.to_dict(), **extra}, sort_keys=False))

    def watch(self, groups: list, each_step: bool = True, switched: list = (), state_bytes: int = 0,
              zoom: tuple[str, ...] = ()) -> None:
        """The groups whose spans make the trace. `each_step`: gathered after every step, for its idle metrics
        (time/idle/deviceN) and the idle counters of the trace; else once at the end. `switched`: the groups that
        context-switch (offload metrics; `state_bytes` their state). `zoom`: components drawn side by side in one
        step of their own timeline (timeline_rollout.png)."""
        self.groups, self.each_step, self.switched = list(groups), each_step, list(switched)
        self.state_bytes, self.zoom = state_bytes, tuple(zoom)
        self.devices = sorted({d for g in groups for devs in g.placement.rank_devices for d in devs})

    def resume_point(self) -> tuple[int, Path | None]:
        """(the step to start from, its checkpoint): the newest complete checkpoint with `run.resume`, else (0, None)."""
        found = self.dir.latest_checkpoint() if self.cfg.run.resume else None
        return found or (0, None)

    def steps(self, start: int):
        """Steps start .. run.steps - 1 under the progress bar, each starting the step's clock. Rows after `start`
        (a resume's) are forgotten first: those steps run again."""
        self.start = start
        if start:
            self.dir.drop_metrics_after(start)
        with progress(self.cfg.run.progress) as bar:
            self._bar, self._task = bar, bar.add_task(self.label, total=self.cfg.run.steps, completed=start, info="")
            for step in range(start, self.cfg.run.steps):
                self._t0, self._w0 = time.perf_counter(), time.time()
                yield step

    def elapsed(self) -> float:
        """Seconds since the current step began."""
        return time.perf_counter() - self._t0

    def checkpoint_due(self, step: int, *more: bool) -> bool:
        """Whether step `step` (0-based) ends with a checkpoint: every run.save_every steps, at the last, or where
        any of `more` holds."""
        every = self.cfg.run.save_every and (step + 1) % self.cfg.run.save_every == 0
        return bool(every or step + 1 == self.cfg.run.steps or any(more))

    def end_step(self, step: int, metrics: dict, evaluation: Callable[[], dict] | None = None, hold: bool = False,
                 seconds: float | None = None, info: str = "") -> dict:
        """Close step `step` (0-based): its seconds (now, unless given) and, with `each_step`, its idle and offload
        metrics join `metrics`; the row is written as step + 1, with `evaluation()`'s metrics once they are in:
        now, or with `hold` when `write_held` is called (the flow's next step is handed out by then, so the
        evaluation overlaps it). Returns the row's metrics without the evaluation's."""
        out = {**metrics, self.clock: self.elapsed() if seconds is None else seconds}
        if self.each_step:
            out |= self._span_metrics()
        self.write_held()
        if evaluation is not None and hold:
            self._held = (step + 1, out, evaluation)
        else:
            self.write(step + 1, out, evaluation)
        self._bar.update(self._task, advance=1, info=info)
        return out

    def write(self, step: int, metrics: dict, evaluation: Callable[[], dict] | None = None) -> None:
        """Write the row of `step`, waiting for `evaluation`'s metrics where there is one."""
        self.dir.log(step, {**metrics, **(evaluation() if evaluation else {})})

    def write_held(self) -> None:
        if self._held:
            held, self._held = self._held, None
            self.write(*held)

    def _span_metrics(self) -> dict:
        now = time.time()
        spans = gather_spans(self.groups, clear=True)
        self.trace += spans if self.cfg.run.trace else []
        out = idle_metrics(spans, self._w0, now, self.devices)
        if self.switched:  # what context switching moved, and how much stays on the devices between steps
            resident = sum(max(h) for h in wait_all([g.state_bytes() for g in self.switched]))
            out |= {**offload_metrics(spans), "offload/state_bytes": self.state_bytes,
                    "offload/resident_bytes": resident}
        self.counters += [{"device": d, "time": self._w0, "name": "idle_fraction",
                           "value": out[f"time/idle/device{d}"] / (now - self._w0)} for d in self.devices]
        return out

    def finish(self, last_step: int | None = None) -> None:
        """After the last step: the held row, the trace (trace.json; with run.plots plots/timeline.png and, with
        `zoom`, one step of those components, `last_step` bounding which), with run.plots the metric plots."""
        self.write_held()
        spans = None
        if self.cfg.run.trace:
            spans = self.trace if self.each_step else [s for g in self.groups for s in g.spans()]
            write_chrome_trace(spans, self.path / "trace.json", counters=self.counters or None)
        if not self.cfg.run.plots:
            return
        if spans is not None:
            plot_timeline(spans, self.path / "plots" / "timeline.png")
            if self.zoom and last_step is not None:  # one step, zoomed in: e.g. env stages and policy side by side
                one = min(self.start + 1, last_step)
                plot_timeline([s for s in spans if s["step"] == one and s["component"] in self.zoom],
                              self.path / "plots" / "timeline_rollout.png", title=f"rollout of iteration {one + 1}")
        self.dir.plot(self.plots)

    def close(self) -> None:
        self.dir.close()
