"""Tool worker: answers the rollout's tool calls (agent.tools) where the plan places it, beside the reward by
default. It runs no model and takes no device lock; each call is traced as a `tool` span. Calls run concurrently
(python and user tools each in a process of their own), so rollout ranks and sequences do not wait on each other.
"""

from __future__ import annotations

from m2flow.reasoning.tasks.tools import ToolCall, Toolbox
from m2flow.runtime import Worker, concurrent


class ToolWorker(Worker):
    def __init__(self, cfg):
        a = cfg.agent
        self.toolbox = Toolbox(a.tools, a.timeout_s, a.memory_mb)

    @concurrent
    def run(self, tool: str, text: str, step: int | None = None) -> tuple[str, str]:
        """One call -> (the answer's text, its status: ok | error | timeout | unknown)."""
        with self.span("tool", step):
            result = self.toolbox.run(ToolCall(tool, text, 0))
        return result.text, result.status
