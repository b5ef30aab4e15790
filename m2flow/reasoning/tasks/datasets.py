"""From a `data:` config section to datasets and the matching reward: built-in synthetic tasks
(generated from the seed, with disjoint held-out splits) or a JSONL/Parquet file.
"""

from __future__ import annotations

from m2flow.reasoning.tasks.data import PromptDataset, load_dataset
from m2flow.reasoning.tasks.synthetic import make_task

DEFAULT_REWARD = {"arithmetic": "exact_match", "countdown": "countdown", "file": "math_verify"}
INLINE_REWARDS = ("exact_match", "digit_match", "countdown")  # pure, fast, cannot hang: no subprocess needed


def reward_name(fn: str, task: str) -> str:
    """`reward.fn`, with 'auto' resolved by the task."""
    return DEFAULT_REWARD[task] if fn == "auto" else fn


def reward_timeout(name: str, timeout_s: float) -> float | None:
    """Built-in pure rewards run inline; anything else runs in a worker process under the timeout."""
    return None if name in INLINE_REWARDS else timeout_s


def task_records(data, seed: int, split: str) -> list[dict]:
    """Records {prompt, answer[, solution]} of the train or test split."""
    if data.task == "file":
        records = load_dataset(data.path, data.prompt_key or None, data.answer_key or None, layout=data.layout)
        cut = max(len(records) - data.eval_size, 1) if len(records) > data.eval_size else len(records)
        return records[:cut] if split == "train" else records[cut:] or records[-1:]
    size = data.train_size if split == "train" else data.eval_size
    kwargs = ({"digits": data.digits, "digits_b": data.digits_b, "ops": data.ops, "answer_width": data.answer_width}
              if data.task == "arithmetic" else {})
    return make_task(data.task, size, seed=seed, split=split, **kwargs)


def build_datasets(data, tokenizer, seed: int) -> tuple[PromptDataset, PromptDataset]:
    """(train, held-out) prompt datasets; the held-out one keeps its order."""
    train = PromptDataset(task_records(data, seed, "train"), tokenizer, data.max_prompt_len, seed=seed)
    test = PromptDataset(task_records(data, seed, "test"), tokenizer, data.max_prompt_len, seed=seed, shuffle=False)
    return train, test
