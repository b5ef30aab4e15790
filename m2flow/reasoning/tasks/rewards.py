"""Verifiable rewards for reasoning RL (exact match, math-verify, countdown), user reward functions by import
path, and `RewardRunner`, which scores calls in killable worker processes with a timeout per call.

No tokenization and no runtime here: a reward function maps (response text, answer) to a float.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import logging
import math
import os
import pickle
import select
import subprocess
import sys
import time
import traceback
from collections import Counter, deque
from fractions import Fraction
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

# End-of-sequence texts that a decoded response may carry; everything from the first one on is ignored.
EOS_MARKERS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<pad>")


def strip_eos(response: str) -> str:
    """Cut the response at the first end-of-sequence marker and strip surrounding whitespace."""
    cut = len(response)
    for marker in EOS_MARKERS:
        at = response.find(marker)
        if at != -1:
            cut = min(cut, at)
    return response[:cut].strip()


def completion_text(tokenizer, ids: Sequence[int], stop_ids: Sequence[int]) -> str:
    """The text a reward scores: the generated tokens up to the first stop token, decoded with every special token
    kept (a `<pad>` the model wrote inside its answer stays there, so `1<pad>57` does not score as `157`)."""
    stops = set(stop_ids)
    cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(list(ids[:cut]), skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------- built-in rewards


def exact_match(response: str, answer: Any) -> float:
    """1.0 if the response (cut at an eos marker, whitespace-stripped) equals str(answer) stripped, else 0.0."""
    return float(strip_eos(response) == str(answer).strip())


def digit_match(response: str, answer: Any) -> float:
    """Exact match with partial credit: 1.0 if exact, else 0.5 x the share of the answer's digits that the
    response has in the same place, counted from the right (ones under ones), and 0 for the wrong length."""
    got, want = strip_eos(response), str(answer).strip()
    if got == want:
        return 1.0
    if len(got) != len(want):
        return 0.0
    return 0.5 * sum(a == b for a, b in zip(reversed(got), reversed(want))) / max(len(want), 1)


def math_verify_reward(response: str, answer: Any) -> float:
    """1.0 if math-verify finds the response's final answer equivalent to `answer`, else 0.0.

    Handles \\boxed{...}, fractions, decimals and equivalent LaTeX forms ("\\boxed{1/2}" matches "0.5" and
    "\\frac{1}{2}"). math-verify's own signal-based timeouts are off (they only work in a main thread);
    run this under `RewardRunner` for a timeout.
    """
    from math_verify import grader, parse, parser, verify

    # The timeouts are off on purpose (RewardRunner provides them): skip math-verify's notice about it.
    parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True
    gold = parse(str(answer), parsing_timeout=None)
    pred = parse(strip_eos(response), parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


def countdown_reward(response: str, answer: Any) -> float:
    """1.0 if the response is an arithmetic expression that uses each of answer["numbers"] exactly once
    (with + - * / and parentheses) and equals answer["target"], else 0.0.

    `answer` is {"numbers": [...], "target": int} or that dict as a JSON string. A trailing "= value" in
    the response is ignored ("3*7+12=33" counts as "3*7+12").
    """
    spec = json.loads(answer) if isinstance(answer, str) else answer
    text = strip_eos(response).split("=")[0].strip()
    if not text or len(text) > 200:
        return 0.0
    try:
        value, used = _eval_expression(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return 0.0
    if Counter(used) != Counter(int(x) for x in spec["numbers"]):
        return 0.0
    return float(value == spec["target"])


_BIN_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _eval_expression(node: ast.AST) -> tuple[Fraction, list[int]]:
    """Exact value of an expression tree of integer literals and + - * / -> (value, literals used)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value), [node.value]
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
        left, used_left = _eval_expression(node.left)
        right, used_right = _eval_expression(node.right)
        return _BIN_OPS[type(node.op)](left, right), used_left + used_right
    raise ValueError(f"not allowed in a countdown expression: {ast.dump(node)}")


REWARD_FNS: dict[str, Callable[[str, Any], float]] = {
    "exact_match": exact_match,
    "digit_match": digit_match,
    "math_verify": math_verify_reward,
    "countdown": countdown_reward,
}


def load_reward_fn(spec: str) -> Callable[[str, Any], float]:
    """A reward function by registry name ("exact_match", "math_verify", "countdown") or "pkg.module:function"."""
    if spec in REWARD_FNS:
        return REWARD_FNS[spec]
    if ":" not in spec:
        raise ValueError(
            f"reward function {spec!r}: not a built-in ({', '.join(REWARD_FNS)}) and not of the form 'pkg.module:function'"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"reward function {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise AttributeError(f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise TypeError(f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not a callable")
    return fn


# ---------------------------------------------------------------------------------------------- runner


def is_batched(fn: Callable) -> bool:
    """A batched (TRL-style) reward function takes a parameter named `completions`:
    `fn(prompts, completions, answers, **kwargs) -> list[float]`, called once per batch with keyword arguments.
    Any other function is called per completion: `fn(response, answer) -> float`."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: per completion
        return False


def _number(value: Any) -> float:
    """A reward as a finite float: a real number (bool, int, float, a 0-d numpy or torch value); anything else, text
    included, is an error naming what came back."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"returned {value!r} ({type(value).__name__}), not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"returned {number}, not a finite number")
    return number


def _score_one(fn: Callable, call: Sequence, batched: bool) -> float | list[float]:
    """Per-completion call (response, answer, ...) -> a float; batched call (prompts, completions, answers, {column:
    values}) -> floats. `batched` is is_batched(fn), decided once per function, not per call."""
    if batched:
        prompts, completions, answers, columns = call
        got = fn(prompts=list(prompts), completions=list(completions), answers=list(answers), **columns)
        if isinstance(got, (str, bytes)) or not hasattr(got, "__iter__"):
            raise TypeError(f"returned {got!r} ({type(got).__name__}), not a list of rewards")
        return [_number(v) for v in got]
    return _number(fn(*call))


def try_reward_fn(spec: str, record: dict, timeout_s: float | None) -> None:
    """Score one sample as a run would (a response equal to the record's answer), under the run's timeout: raise
    ValueError, one line, if the function raises, returns anything but a finite number (or a list of them, batched),
    or does not return in time. Before a run, so that a function that cannot score fails in a second."""
    response, answer, columns = str(record["answer"]), record["answer"], record.get("columns", {})
    with RewardRunner(spec, timeout_s=timeout_s, max_workers=1) as runner:
        runner.quiet = True
        call = (f"fn(prompts=[...], completions=[{response!r}], answers=[{answer!r}]"
                f"{''.join(f', {k}=[...]' for k in columns)})" if runner.batched else f"fn({response!r}, {answer!r})")
        where = f"(called as {call} on a record of the run's data)"
        try:
            _, counts = runner.score_texts([record.get("prompt", "")], [response], [answer], [columns])
        except ValueError as e:  # a batched function's count of rewards
            raise ValueError(f"{e} {where}") from None
    if counts["timeouts"]:
        raise ValueError(f"reward function {spec!r} did not return within reward.timeout_s={timeout_s:g}s {where}")
    if counts["errors"]:
        raise ValueError(f"reward function {spec!r} {runner.first_error} {where}")


class RewardRunner:
    """Scores (response, answer) calls with `fn`, each call under a timeout, in `max_workers` worker processes.

    A call that raises, returns a non-number, or runs past `timeout_s` scores 0.0 and is counted; the hung
    worker process is killed and replaced. Nothing here uses signals, so it works from any thread (e.g.
    inside a Ray actor). `timeout_s=None` runs calls inline in this process (no timeout; for trusted
    built-ins). `fn` must be importable by the workers (a module-level function, or a spec string).
    Use as a context manager, or call `close()`, to stop the workers.
    """

    def __init__(self, fn: Callable | str, timeout_s: float | None = 10.0, max_workers: int = 2):
        self.fn = load_reward_fn(fn) if isinstance(fn, str) else fn
        self.batched = is_batched(self.fn)
        self.timeout_s = timeout_s
        self.max_workers = max(1, max_workers)
        self.startup_timeout_s = 120.0
        self._workers: list[_Worker] = []
        self.first_error: str | None = None  # the first failed call's error, one line ("raised TypeError: ...")
        self.quiet = False  # True: a failed call is not logged
        if timeout_s is not None:
            try:
                self._fn_bytes = pickle.dumps(self.fn)
            except Exception as e:
                raise TypeError(
                    f"RewardRunner: reward function {self.fn!r} cannot be sent to a worker process ({e}); "
                    "use a module-level function or a 'pkg.module:function' spec, or timeout_s=None to run inline"
                ) from e

    def score_texts(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence,
                    columns: Sequence[dict] | None = None) -> tuple[list[float], dict[str, int]]:
        """One reward per completion, whichever form the function has: per completion, each call under the timeout;
        batched, one call for all of them under the timeout (if it raises or runs past it, all score 0 and it is
        counted once), with each dataset column (`columns[i]`: completion i's record's other columns) as a keyword
        argument holding one value per completion. A batched function that returns the wrong number of rewards is
        an error, raised."""
        if not self.batched:
            return self.score(list(zip(completions, answers)))
        rows = list(columns) if columns is not None else [{}] * len(completions)
        names = sorted({k for row in rows for k in row} - {"prompts", "completions", "answers"})
        by_name = {k: [row.get(k) for row in rows] for k in names}
        (got,), counts = self.score([(list(prompts), list(completions), list(answers), by_name)])
        if not isinstance(got, list):  # the call failed or timed out: scored 0.0 and counted
            return [0.0] * len(completions), counts
        if len(got) != len(completions):
            name = f"{getattr(self.fn, '__module__', '?')}:{getattr(self.fn, '__qualname__', self.fn)}"
            raise ValueError(f"reward function {name} (batched) returned "
                             f"{len(got)} rewards for {len(completions)} completions")
        return got, counts

    def score(self, calls: Sequence[Sequence]) -> tuple[list[float], dict[str, int]]:
        """calls[i] = (response, answer, ...) -> (rewards[i] floats, {"timeouts": k, "errors": m})."""
        counts = {"timeouts": 0, "errors": 0}
        if self.timeout_s is None:
            rewards = []
            for call in calls:
                try:
                    rewards.append(_score_one(self.fn, call, self.batched))
                except Exception:
                    rewards.append(0.0)
                    self._count_error(counts, traceback.format_exc())
            return rewards, counts
        return self._score_in_workers(list(calls), counts), counts

    def _score_in_workers(self, calls: list, counts: dict[str, int]) -> list[float]:
        rewards = [0.0] * len(calls)
        queue = deque(range(len(calls)))
        while len(self._workers) < min(self.max_workers, len(calls)):
            self._workers.append(_Worker.start(self._fn_bytes))
        while queue or any(w.task is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and queue:
                    i = queue.popleft()
                    w.send_task(i, calls[i], self.timeout_s)
            self._wait_for_any()
            for k, w in enumerate(self._workers):
                self._collect(k, w, rewards, counts)
        return rewards

    def _wait_for_any(self) -> None:
        waiting = [w for w in self._workers if not w.ready or w.task is not None]
        deadlines = [w.deadline if w.ready else w.started + self.startup_timeout_s for w in waiting]
        wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0
        select.select([w.out for w in waiting], [], [], wait)

    def _collect(self, k: int, w: "_Worker", rewards: list[float], counts: dict[str, int]) -> None:
        """Handle whatever worker k has to say: ready, a result, death, or a deadline passed."""
        if w.readable():
            try:
                msg = w.recv()
            except (EOFError, OSError, pickle.UnpicklingError):
                msg = ("died", f"reward worker process exited with code {w.proc.poll()}")
            kind, payload = msg[0], msg[-1]
            if kind == "ready":
                w.ready = True
            elif kind == "init_error":
                self.close()
                raise RuntimeError(f"RewardRunner: a worker could not load the reward function:\n{payload}")
            elif not w.ready:
                self.close()
                raise RuntimeError(f"RewardRunner: a worker process failed to start: {payload}")
            elif kind == "ok":
                rewards[w.task] = payload
                w.task = None
            else:  # "error" from the function, or "died" while running it
                rewards[w.task] = 0.0
                w.task = None
                self._count_error(counts, payload)
                if kind == "died":
                    self._workers[k] = _Worker.start(self._fn_bytes)
            return
        now = time.monotonic()
        if w.ready and w.task is not None and now >= w.deadline:
            rewards[w.task] = 0.0
            counts["timeouts"] += 1
            w.kill()
            self._workers[k] = _Worker.start(self._fn_bytes)
        elif not w.ready and now >= w.started + self.startup_timeout_s:
            self.close()
            raise RuntimeError(f"RewardRunner: a worker did not start within {self.startup_timeout_s:.0f}s")

    def _count_error(self, counts: dict[str, int], tb: str) -> None:
        counts["errors"] += 1
        if self.first_error is None:
            self.first_error = _one_line(tb)
            if not self.quiet:
                logger.warning("reward function %r failed (scored 0; later failures are only counted):\n%s", self.fn,
                               tb)

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _one_line(tb: str) -> str:
    """A traceback's last line as what the call did: 'returned 'high' (str), not a number' for m2flow's own checks of
    the value, 'raised TypeError: ...' for the function's own exception; a worker's death as it is."""
    last = (tb.strip().splitlines() or ["?"])[-1]
    kind, _, message = last.partition(": ")
    if message.startswith("returned "):
        return message
    return f"raised {last}" if kind.replace(".", "").replace("_", "").isalnum() else last


def import_path() -> str:
    """This process's import path as a PYTHONPATH for a child process (absolute, the working directory for '')."""
    return os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)


class _Worker:
    """One reward worker subprocess speaking pickles over its stdin/stdout; at most one task in flight."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.out = proc.stdout
        self.ready = False
        self.started = time.monotonic()
        self.task: int | None = None
        self.deadline = math.inf

    @classmethod
    def start(cls, fn_bytes: bytes) -> "_Worker":
        env = dict(os.environ)
        env["PYTHONPATH"] = import_path()
        proc = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        proc.stdin.write(fn_bytes)
        proc.stdin.flush()
        return cls(proc)

    def send_task(self, i: int, call: Sequence, timeout_s: float) -> None:
        self.task, self.deadline = i, time.monotonic() + timeout_s
        try:
            pickle.dump(tuple(call), self.proc.stdin)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the worker died; recv() will see EOF and report it

    def readable(self) -> bool:
        return bool(select.select([self.out], [], [], 0)[0])

    def recv(self) -> tuple:
        return pickle.load(self.out)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._close_pipes()

    def stop(self) -> None:
        try:
            pickle.dump(None, self.proc.stdin)
            self.proc.stdin.flush()
            self.proc.wait(timeout=2)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass


def _worker_main() -> None:
    """Reward worker process: load fn from stdin, then answer each call pickle with ("ok", value) or ("error", tb).

    The protocol owns the real stdout; fd 1 is pointed at stderr so that prints in user code cannot corrupt it.
    """
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    proto_in = sys.stdin.buffer

    def send(msg: tuple) -> None:
        pickle.dump(msg, proto_out)
        proto_out.flush()

    try:
        fn = pickle.load(proto_in)
        batched = is_batched(fn)
    except BaseException:
        send(("init_error", traceback.format_exc()))
        return
    send(("ready",))
    while True:
        call = pickle.load(proto_in)
        if call is None:
            return
        try:
            send(("ok", _score_one(fn, call, batched)))
        except BaseException:
            send(("error", traceback.format_exc()))
