"""m2flow: RL training where one driver (the macro flow) runs under any execution plan (the micro flow).

    import m2flow
    result = m2flow.train("grpo_arithmetic", ["run.steps=50"])   # docs/api.md

`import m2flow` loads nothing: the API (m2flow/api.py) and subpackages load on first use.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["TrainResult", "evaluate", "load_config", "measure_plan", "train", "__version__"]
_API = {"TrainResult", "evaluate", "load_config", "measure_plan", "train"}


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module("m2flow.api"), name)
    try:  # m2flow.config, m2flow.runtime, ... as attributes
        return importlib.import_module(f"m2flow.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"m2flow.{name}":  # the submodule exists but something it imports does not
            raise
        raise AttributeError(f"module 'm2flow' has no attribute {name!r}") from None
