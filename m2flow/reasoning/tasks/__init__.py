"""The reasoning tasks: prompt datasets (JSONL/Parquet, synthetic arithmetic/countdown) and verifiable rewards.

Light on purpose (no torch import): reward worker processes import this package.
"""

from m2flow.reasoning.tasks.data import LAYOUTS, PromptDataset, load_dataset
from m2flow.reasoning.tasks.rewards import REWARD_FNS, RewardRunner, load_reward_fn
from m2flow.reasoning.tasks.synthetic import TASKS, arithmetic, countdown, make_task

__all__ = [
    "LAYOUTS",
    "PromptDataset",
    "load_dataset",
    "REWARD_FNS",
    "RewardRunner",
    "load_reward_fn",
    "TASKS",
    "arithmetic",
    "countdown",
    "make_task",
]
