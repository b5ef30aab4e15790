"""Loading checkpoint state without running code: tensors and plain data (numbers, strings, lists, tuples, dicts)
only, never arbitrary pickled objects, so a checkpoint someone shared cannot execute anything when loaded."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


def load_plain(path: str | Path) -> Any:
    """`torch.load(path, weights_only=True)`, with an error that says what was refused and why."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: refused to load: it holds Python objects beyond tensors and plain data, which "
                         f"could run code when unpickled ({first[:200]}); only load checkpoints you trust the origin "
                         f"of, re-saved by m2flow") from None
