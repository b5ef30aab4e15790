"""What every flow's profiler mixes into the workers it times: `Probe.timed` calls one of a worker's methods and
returns its seconds, peak memory and when it put its outputs. The reduction of repeated timings to one measurement
per cell is the planner's (`planner.profile.median_rows`)."""

from __future__ import annotations

import threading
import time

import psutil
import torch

from m2flow.runtime.channel import Channel
from m2flow.runtime.group import concurrent
from m2flow.runtime.stream import END, drain


class Probe:
    """Mixed into a component's worker: call one of its methods timed, with peak memory and when it put outputs."""

    def timed(self, method: str, *args) -> dict:
        puts: list[tuple[float, float]] = []
        args = tuple(_Stamped(a, puts) if isinstance(a, Channel) else a for a in args)
        gpu = bool(self.devices) and self.devices[0].kind == "gpu"
        self.tracer.spans(clear=True)
        peak = [0]
        stop = threading.Event()
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        else:
            proc = psutil.Process()
            peak[0] = proc.memory_info().rss

            def sample():
                while not stop.wait(0.005):
                    peak[0] = max(peak[0], proc.memory_info().rss)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
        start = time.perf_counter()
        try:
            result = getattr(self, method)(*args)
        finally:
            seconds = time.perf_counter() - start
            stop.set()
        if gpu:
            peak[0] = torch.cuda.max_memory_allocated()
        else:
            sampler.join()
            peak[0] = max(peak[0], proc.memory_info().rss)
        spans = {}
        for s in self.tracer.spans(clear=True):
            spans[s["phase"]] = spans.get(s["phase"], 0.0) + s["end"] - s["start"]
        # one process spanning several devices holds its memory once: per device it is a share
        return dict(result=result, seconds=seconds, peak_bytes=peak[0] // max(len(self.devices), 1),
                    puts=[(a - start, b - start) for a, b in puts], spans=spans)

    def state_bytes(self) -> int:
        """Bytes of the registered state (weights, optimizer state), counted once."""
        seen, total = set(), 0
        for obj in self.__dict__.get("_m2flow_offloadables", {}).values():
            tensors = list(obj.parameters()) + list(obj.buffers()) if isinstance(obj, torch.nn.Module) else \
                [v for st in obj.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            for t in tensors:
                if id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return total

    def model_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.state_dict().values())

    def consume(self, inp) -> tuple[int, float]:
        """Take items from `inp` until END: (items, seconds)."""
        start = time.perf_counter()
        n = sum(1 for _ in drain(inp))
        return n, time.perf_counter() - start

    @concurrent
    def machine(self, devices_on_node: int) -> tuple[str, int]:
        """(device kind, usable memory bytes per device) as this rank sees it: a GPU's name and memory, or a CPU
        slot's core count and its share of the node's RAM."""
        if self.devices and self.devices[0].kind == "gpu":
            props = torch.cuda.get_device_properties(0)
            return props.name, props.total_memory
        cores = len(self.devices[0].cores) if self.devices else 1
        return f"cpu-slot-{cores}core", psutil.virtual_memory().total // max(devices_on_node, 1)


class _Stamped:
    """A channel that notes when each put of an item (not END) started and ended."""

    def __init__(self, channel, puts: list):
        self._channel, self._puts = channel, puts

    def put(self, item, *args, **kwargs):
        start = time.perf_counter()
        self._channel.put(item, *args, **kwargs)
        if not (isinstance(item, str) and item == END):
            self._puts.append((start, time.perf_counter()))

    def __getattr__(self, name):
        return getattr(self._channel, name)
