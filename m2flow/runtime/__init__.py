"""m2flow.runtime: cluster, placement, worker groups, channels, device locks, offload, priority and tracing. Knows nothing about RL."""

from .channel import Channel, ChannelClosed, ChannelItemLost, ChannelTimeout
from .cluster import Cluster, Device
from .group import (Group, Handle, Worker, WorkerError, concurrent, gather_spans, launch_all, launch_cohosted,
                    release_all, running, wait_all)
from .lock import DeviceLock
from .offload import offload_state, onload_state
from .placement import ComponentPlacement, Placement, PlacementError, parse_placement
from .priority import foreground
from .tracer import Tracer, busy_seconds, plot_timeline, write_chrome_trace

__all__ = [
    "Channel", "ChannelClosed", "ChannelItemLost", "ChannelTimeout",
    "Cluster", "Device", "Group", "Handle", "Worker", "WorkerError", "concurrent", "gather_spans", "launch_all",
    "launch_cohosted", "release_all", "running", "wait_all", "DeviceLock", "foreground",
    "offload_state", "onload_state", "ComponentPlacement", "Placement", "PlacementError", "parse_placement",
    "Tracer", "busy_seconds", "plot_timeline", "write_chrome_trace",
]
