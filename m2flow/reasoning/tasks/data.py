"""Prompt datasets for reasoning RL: load JSONL/Parquet records (plain, GSM8K or MATH layout) and serve
tokenized prompts in seeded, resumable epochs. No generation and no rewards here."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger(__name__)

# Named layouts: which columns hold the prompt and the answer, and how to pull the final answer out.
LAYOUTS = {
    "plain": {"prompt_key": "prompt", "answer_key": "answer", "extract": None},
    "gsm8k": {"prompt_key": "question", "answer_key": "answer", "extract": "gsm8k"},  # "... #### 42"
    "math": {"prompt_key": "problem", "answer_key": "solution", "extract": "boxed"},  # "... \boxed{42}"
}


def load_dataset(
    path: str | Path,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    extract: str | None = None,
    layout: str = "plain",
) -> list[dict]:
    """Read a .jsonl / .json / .parquet file into records {"prompt": str, "answer": Any, "columns": {the row's other
    columns}[, "solution": str]} (batched reward functions get the columns as keyword arguments).

    `layout` ("plain", "gsm8k", "math") gives default keys and extraction; explicit arguments win.
    extract="gsm8k" keeps the text after the last "####" (commas removed), extract="boxed" the content of
    the last \\boxed{...}; the full answer text is then kept as "solution" (a reference response for SFT).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"load_dataset: layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    defaults = LAYOUTS[layout]
    prompt_key = prompt_key or defaults["prompt_key"]
    answer_key = answer_key or defaults["answer_key"]
    extract = extract if extract is not None else defaults["extract"]
    if extract not in (None, "gsm8k", "boxed"):
        raise ValueError(f"load_dataset: extract must be None, 'gsm8k' or 'boxed', got {extract!r}")

    p = Path(path)
    rows = _read_rows(p)
    if not rows:
        raise ValueError(f"{p}: the dataset is empty (no records)")
    found = sorted({k for row in rows for k in row})
    missing = [k for k in (prompt_key, answer_key) if k not in found]
    if missing:
        raise ValueError(f"{p}: missing column(s) {missing}; columns found: {found}")

    records = []
    for i, row in enumerate(rows):
        for key in (prompt_key, answer_key):
            if row.get(key) is None:
                raise ValueError(f"{p}: record {i} has no value for {key!r}")
        record = {"prompt": str(row[prompt_key]), "answer": row[answer_key],
                  "columns": {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}}
        if extract is not None:
            text = str(row[answer_key])
            record["answer"] = _extract(text, extract, where=f"{p}: record {i} ({answer_key!r})")
            record["solution"] = text
        records.append(record)
    return records


def _read_rows(p: Path) -> list[dict]:
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
        return rows
    if suffix == ".json":
        rows = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{p}: expected a JSON list of objects")
        return rows
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(p).read().to_pylist()  # (read_table would import pyarrow.dataset: ~1 s)
        except pa.ArrowException as e:
            raise ValueError(f"{p}: not a readable Parquet file ({e})") from None
    raise ValueError(f"{p}: unsupported file type {suffix!r} (expected .jsonl, .json or .parquet)")


def _extract(text: str, how: str, where: str) -> str:
    if how == "gsm8k":
        if "####" not in text:
            raise ValueError(f"{where}: no '#### <answer>' marker in {text[-80:]!r}")
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    boxed = last_boxed(text)
    if boxed is None:
        raise ValueError(f"{where}: no \\boxed{{...}} in {text[-80:]!r}")
    return boxed


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in text, braces matched; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start == -1:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


class PromptDataset:
    """Tokenized prompts served in epochs: `next_batch(n)` continues across epoch ends, reshuffling each epoch.

    Items are {"index", "prompt", "prompt_ids", "answer"} (+ "solution" when the record has one).
    use_chat_template: "auto" uses the tokenizer's chat template when it has one, True requires it, False
    encodes the raw prompt. Prompts over `max_prompt_len` tokens are dropped (count in `.dropped`).
    The order depends only on (seed, epoch): `state_dict()` / `load_state_dict()` resume it exactly.
    """

    def __init__(
        self,
        records: Sequence[dict],
        tokenizer,
        max_prompt_len: int,
        use_chat_template: bool | str = "auto",
        seed: int = 0,
        shuffle: bool = True,
        system_prompt: str | None = None,
    ):
        if not records:
            raise ValueError("PromptDataset: no records")
        if use_chat_template not in (True, False, "auto"):
            raise ValueError(f"PromptDataset: use_chat_template must be True, False or 'auto', got {use_chat_template!r}")
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if use_chat_template is True and not has_template:
            raise ValueError("PromptDataset: use_chat_template=True but the tokenizer has no chat template")
        self.use_chat_template = has_template if use_chat_template == "auto" else use_chat_template
        self.seed, self.shuffle = seed, shuffle

        self.items: list[dict] = []
        longest = 0
        for i, record in enumerate(records):
            ids = self._encode(tokenizer, record["prompt"], system_prompt)
            longest = max(longest, len(ids))
            if len(ids) > max_prompt_len:
                continue
            item = {"index": i, "prompt": record["prompt"], "prompt_ids": ids, "answer": record.get("answer"),
                    "columns": record.get("columns", {})}
            if "solution" in record:
                item["solution"] = record["solution"]
            self.items.append(item)
        self.dropped = len(records) - len(self.items)
        if not self.items:
            raise ValueError(
                f"PromptDataset: all {len(records)} prompts are longer than max_prompt_len={max_prompt_len} "
                f"tokens (longest: {longest}); raise max_prompt_len"
            )
        if self.dropped:
            logger.warning(
                "PromptDataset: dropped %d of %d prompts longer than max_prompt_len=%d tokens (longest: %d)",
                self.dropped, len(records), max_prompt_len, longest,
            )
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order(0)

    def _encode(self, tokenizer, prompt: str, system_prompt: str | None) -> list[int]:
        if not self.use_chat_template:
            text = prompt if system_prompt is None else f"{system_prompt}\n{prompt}"
            return list(tokenizer(text, add_special_tokens=True)["input_ids"])
        messages = [{"role": "user", "content": prompt}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[dict]:
        """The next n items (n may exceed the dataset size); crossing an epoch end starts a fresh shuffle."""
        batch = []
        while len(batch) < n:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(batch), len(self._order) - self.cursor)
            batch.extend(self.items[j] for j in self._order[self.cursor : self.cursor + take])
            self.cursor += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "size": len(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != len(self.items) or state["seed"] != self.seed:
            raise ValueError(
                f"PromptDataset.load_state_dict: state is for size={state['size']}, seed={state['seed']}, "
                f"this dataset has size={len(self.items)}, seed={self.seed}"
            )
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._epoch_order(self.epoch)
