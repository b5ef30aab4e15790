"""m2flow: RL training where one driver (the macro flow) runs under any execution plan (the micro flow).

    import m2flow
    result = m2flow.train("grpo_arithmetic", ["run.steps=50"])   # docs/api.md
"""

from m2flow.api import TrainResult, evaluate, load_config, train

__version__ = "0.1.0"
__all__ = ["TrainResult", "evaluate", "load_config", "train", "__version__"]
