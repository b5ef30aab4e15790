"""The predicted schedule of a plan as a PNG: one lane per device group, a box per micro-batch per stage,
beside (below, on the same time axis) the collocated plan's. It draws predictions only; measured
timelines of real runs are drawn by m2flow.runtime.tracer.
"""

from __future__ import annotations

from pathlib import Path

from m2flow.planner.cost import Box, CostModel, schedule
from m2flow.planner.profile import Profile

__all__ = ["plot_predicted"]

_SWITCH, _SYNC = "#9e9e9e", "#424242"


def plot_predicted(profile: Profile, candidate, path: str | Path, compare=None) -> str:
    """Save the predicted step of `candidate` (a search Candidate) and, if given, of `compare` (e.g. the
    collocated candidate) as panels sharing the time axis. Returns `path`."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # no pyplot: no global state, the Agg canvas is used for savefig
    from matplotlib.patches import Patch

    model = CostModel(profile, candidate.batch)
    colors = {c: colormaps["tab10"](i % 10) for i, c in enumerate(profile.stages)}
    panels = [("chosen", candidate)] + ([("collocated", compare)] if compare is not None else [])
    lanes = [len(c.layout.groups) for _, c in panels]
    fig = Figure(figsize=(13, 1.6 + 0.55 * sum(lanes) + 0.9 * len(panels)))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [n + 1.2 for n in lanes]})[:, 0]
    total = max(c.seconds for _, c in panels)
    for ax, (name, cand) in zip(axes, panels):
        boxes = schedule(model, cand.layout, cand.batch, cand.micro_batch, cand.loop_stages, cand.offload,
                         cand.loop_ranks)
        _draw(ax, cand, boxes, colors, total)
        stages = f", {cand.loop_stages} loop stages" if cand.loop_stages > 1 else ""
        what = name if name == cand.mode else f"{name} ({cand.mode})"
        ax.set_title(f"{what}: [{cand.spec}]  micro-batch {cand.micro_batch}{stages}, "
                     f"offload {'on' if cand.offload else 'off'}  ->  {cand.seconds:.3g} s per step",
                     fontsize=9, loc="left")
    axes[-1].set_xlabel("predicted seconds within one training step")
    handles = [Patch(color=colors[c], label=c) for c in profile.stages]
    handles += [Patch(facecolor=_SWITCH, hatch="//", label="offload/onload"), Patch(color=_SYNC, label="weight sync")]
    fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(handles))
    fig.suptitle(f"{profile.flow}: predicted schedule on {candidate.num_devices} device(s), {candidate.batch} samples "
                 f"per step", fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return str(path)


def _draw(ax, cand, boxes: list[Box], colors: dict, total: float) -> None:
    n = len(cand.layout.groups)
    for b in boxes:
        width = max(b.end - b.start, 1e-9)
        for lane in range(n) if b.lane is None else [b.lane]:
            if b.kind == "switch":
                style = {"facecolors": _SWITCH, "hatch": "//", "edgecolor": "white"}
            elif b.kind == "sync":
                style = {"facecolors": _SYNC}
            else:
                style = {"facecolors": colors.get(b.component, _SWITCH), "edgecolor": "white", "linewidth": 0.5,
                         "alpha": 0.65 if b.kind == "loop" else 1.0}
            ax.broken_barh([(b.start, width)], (lane - 0.38, 0.76), **style)
            if width > 0.06 * total and b.kind != "switch":
                text = b.component if b.micro is None else f"{b.component} {b.micro}"
                if b.kind == "loop":
                    text = f"{b.component} ({cand.loop_stages} sub-batches, interleaved)"
                ax.text(b.start + width / 2, lane, text, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(n), [cand.layout.label(g) + (f" (+{','.join(cand.layout.shared)})" if cand.layout.shared else "")
                             for g in range(n)], fontsize=8)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, total * 1.01)
    ax.grid(axis="x", alpha=0.3)
