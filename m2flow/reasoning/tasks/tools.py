"""Tools for agentic rollouts: the calls a model writes, the tools that answer them and the text that goes back.

A call is a tag pair in the model's text, `<calc>123*45</calc>`; its answer goes back as `<result>5535</result>`
(or `<result>error: ...</result>`), after which the model goes on writing. Built in: `calc`, a safe arithmetic
parser (Python's `ast`, never `eval`: numbers, + - * / // % **, parentheses, with bounds on size), and `python`, a
snippet run in a subprocess of its own (a time limit, a memory limit, no network, its stdout as the result). A
user tool is a function given by import path (`pkg.mod:fn`), called with the call's text and returning text.

Pure text in and text out: no Ray, no torch, no model. A tool that raises, runs past its time or returns a
non-string never raises here: the model gets an error string, and the caller counts it (`ToolResult.status`).
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from m2flow.reasoning.tasks.rewards import import_path

__all__ = ["AgentHook", "ToolCall", "ToolResult", "Toolbox", "calc", "final_answer", "find_call", "format_result",
           "load_tool", "run_python", "run_user_tool", "tool_trace"]

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
MAX_RESULT_CHARS = 200  # a tool's answer is cut to this many characters (the model's context is short)
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


@dataclass(frozen=True)
class ToolCall:
    tool: str  # the tag's name: "calc" for <calc>...</calc>
    text: str  # what stands between the tags
    end: int  # index in the searched text just past the closing tag


@dataclass(frozen=True)
class ToolResult:
    text: str  # what goes back to the model, between <result> and </result>
    status: str  # "ok", "error" (the tool raised or refused the input), "timeout", "unknown" (no such tool)


def find_call(text: str, tools) -> ToolCall | None:
    """The call that ends `text`: `<name>...</name>` with `name` one of `tools`, its closing tag the last thing in
    `text` (trailing whitespace aside). A rollout stops a sequence at a closing tag and asks this; None when the
    text does not end in a complete call of a known tool."""
    stripped = text.rstrip()
    for name in tools:
        close = f"</{name}>"
        if stripped.endswith(close):
            start = stripped.rfind(f"<{name}>", 0, len(stripped) - len(close))
            if start >= 0:
                body = stripped[start + len(name) + 2:len(stripped) - len(close)]
                return ToolCall(name, body, len(stripped))
    return None


def format_result(result: ToolResult) -> str:
    """The text appended after a call: `<result>...</result>` (the answer cut to MAX_RESULT_CHARS)."""
    return f"{RESULT_OPEN}{result.text[:MAX_RESULT_CHARS]}{RESULT_CLOSE}"


# ---------------------------------------------------------------------------------------------- calculator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10 ** 40


def calc(expression: str) -> str:
    """The value of an arithmetic expression: integer and decimal numbers, + - * / // % ** and parentheses.
    Integers stay exact; a division gives a decimal (12 significant digits, an integral one without its point).
    Anything else (names, calls, attributes, strings), an exponent above MAX_EXPONENT, a value beyond
    MAX_MAGNITUDE or a division by zero raises ValueError with a short reason (the model sees it)."""
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {text!r}") from None
    value = _value(tree.body)
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} above {MAX_EXPONENT}")
        try:
            value = _OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("number too large") from None
        if isinstance(value, complex):
            raise ValueError("not a real number")
        if abs(value) > MAX_MAGNITUDE or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError("number too large")
        return value
    raise ValueError(f"not allowed in an arithmetic expression: {type(node).__name__}")


# ---------------------------------------------------------------------------------------------- python

# run before the snippet: no sockets (so no network), no subprocesses
_SANDBOX = """
import socket as _s, subprocess as _p, os as _o
def _refuse(*a, **k):
    raise PermissionError("the python tool has no network and cannot start processes")
_s.socket = _s.create_connection = _s.socketpair = _refuse
_p.Popen = _refuse
_o.system = _o.fork = _o.execv = _o.execve = _o.spawnv = _refuse
del _s, _p, _o, _refuse
"""


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 256) -> str:
    """Run a snippet in a fresh, isolated Python process (`-I`: no user site, no environment variables read) with
    `timeout_s` of wall time, `memory_mb` of address space and no network; -> its stdout (stripped). A snippet that
    raises gives `ValueError` with its last error line; one that runs past its time gives `TimeoutError`."""
    return _in_subprocess(["-I", "-c", _SANDBOX + code], "", timeout_s, memory_mb, {"PATH": os.defpath}).strip()


# a user tool in a process of its own: imported there, called with stdin's text, its answer on stdout
_CALL_TOOL = """
import importlib, sys
module, _, attr = sys.argv[1].partition(":")
out = getattr(importlib.import_module(module), attr)(sys.stdin.read())
if not isinstance(out, str):
    raise TypeError(f"the tool returned a {type(out).__name__}, not text")
sys.stdout.write(out)
"""


def run_user_tool(spec: str, text: str, timeout_s: float = 5.0, memory_mb: int = 1024) -> str:
    """Call the tool `spec` (`pkg.module:function`) with `text` in a process of its own (this one's import path,
    `timeout_s` of wall time, `memory_mb` of address space): a tool that hangs or eats memory is cut there."""
    env = {"PATH": os.defpath, "PYTHONPATH": import_path()}
    return _in_subprocess(["-c", _CALL_TOOL, spec], text, timeout_s, memory_mb, env)


def _in_subprocess(args: list[str], stdin: str, timeout_s: float, memory_mb: int, env: dict) -> str:
    def limit():  # in the child, before it starts Python
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        os.setsid()  # its own session: nothing it starts outlives it on a timeout

    try:
        done = subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=timeout_s,
                              preexec_fn=limit, env=env)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"ran past {timeout_s:g} s") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise ValueError(lines[-1] if lines else f"exit code {done.returncode}")
    return done.stdout


# ---------------------------------------------------------------------------------------------- toolbox


def load_tool(spec: str) -> Callable[[str], str]:
    """A user tool by import path, `pkg.module:function` (called with the call's text, returning text), checked
    here so that a bad path fails at the start, in one line."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"tool {spec!r}: expected 'calc', 'python' or an import path 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"tool {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AttributeError(f"tool {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


class Toolbox:
    """The tools of a run by tag name -> `run(call) -> ToolResult`, never raising for what a tool does.

    `tools` maps a tag name to "calc", "python" or an import path `pkg.mod:fn`. calc runs in this process (its
    parser bounds it); the python tool and user tools each run in a process of their own per call, under
    `timeout_s` and `memory_mb` (cut there: "timeout"), which costs a Python start (~30 ms) per call.
    """

    BUILT_IN = {"calc": calc}

    def __init__(self, tools: dict[str, str], timeout_s: float = 5.0, memory_mb: int = 256):
        if not tools:
            raise ValueError("a toolbox needs at least one tool, e.g. {'calc': 'calc'}")
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.fns: dict[str, Callable[[str], str]] = {}
        for name, spec in tools.items():
            if not _NAME.match(name) or name == "result":
                raise ValueError(f"tool name {name!r}: expected lower-case letters, digits and _ (not 'result'), "
                                 "used as its tag <name>...</name>")
            if spec == "python":
                self.fns[name] = lambda code: run_python(code, self.timeout_s, self.memory_mb)
            elif spec in self.BUILT_IN:
                self.fns[name] = self.BUILT_IN[spec]
            else:
                load_tool(spec)
                self.fns[name] = lambda text, spec=spec: run_user_tool(spec, text, self.timeout_s,
                                                                       max(self.memory_mb, 1024))

    @property
    def names(self) -> list[str]:
        return list(self.fns)

    def run(self, call: ToolCall) -> ToolResult:
        fn = self.fns.get(call.tool)
        if fn is None:
            return ToolResult(f"error: no tool named {call.tool!r}", "unknown")
        try:
            out = fn(call.text)
        except TimeoutError as e:
            return ToolResult(f"error: timed out ({e})", "timeout")
        except Exception as e:  # noqa: BLE001 - whatever a tool does goes back to the model as text
            return ToolResult(f"error: {e}" if str(e) else f"error: {type(e).__name__}", "error")
        if not isinstance(out, str):
            return ToolResult(f"error: the tool returned a {type(out).__name__}, not text", "error")
        return ToolResult(out, "ok")


def final_answer(text: str) -> str:
    """What a multi-turn response answers: the text after its last tool result (all of it when it has none); the
    reward scores this."""
    cut = text.rfind(RESULT_CLOSE)
    return text if cut < 0 else text[cut + len(RESULT_CLOSE):]


def tool_trace(tool: str, call: str, answer: str) -> str:
    """A reference response that uses a tool once, for a supervised warm start: `<calc>37+45</calc><result>82</result>82`."""
    return f"<{tool}>{call}</{tool}>{RESULT_OPEN}{answer}{RESULT_CLOSE}{answer}"


class AgentHook:
    """The engine's ToolHook for a Toolbox: `encode(text) -> ids`, `decode(ids) -> text` (the policy's tokenizer).
    It answers at most `max_turns` calls per response (a later call gets nothing back and the model writes on), and
    counts what happened: calls, ok, error, timeout, unknown, over_turns. Calculator calls are answered at once;
    the others (a process each) run on `workers` threads, and the engine lets the other sequences decode meanwhile."""

    def __init__(self, toolbox: Toolbox, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 max_turns: int, workers: int = 8):
        self.toolbox, self.encode, self.decode, self.max_turns = toolbox, encode, decode, max_turns
        self.triggers = [encode(f"</{name}>") for name in toolbox.names]
        self.counts: dict[str, int] = {}
        self.turns: dict[tuple[int, int], int] = {}  # calls answered per (prompt, sample) of this generate call
        self.inline = {name for name, fn in toolbox.fns.items() if fn in Toolbox.BUILT_IN.values()}
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="m2flow-tool")
        self.lock = threading.Lock()
        # where calls go instead of `toolbox`: an object whose run(tool, text, step) returns a handle with wait()
        # -> [(text, status)] (the tool component's group, one rank); every call then comes back later
        self.remote, self.step = None, None

    def __call__(self, prompt_index: int, sample_index: int, response_ids: list[int]) -> list[int] | None:
        text = self.decode(response_ids)
        call = find_call(text, self.toolbox.names)
        if call is None:
            return None
        self._count("calls")
        key = (prompt_index, sample_index)
        if self.turns.get(key, 0) >= self.max_turns:
            self._count("over_turns")
            return None
        self.turns[key] = self.turns.get(key, 0) + 1
        if call.tool in self.inline and self.remote is None:
            return self._answer(call)
        return self.pool.submit(self._answer, call)

    def _answer(self, call: ToolCall) -> list[int]:
        if self.remote is None:
            result = self.toolbox.run(call)
        else:
            result = ToolResult(*self.remote.run(call.tool, call.text, self.step).wait()[0])
        self._count(result.status)
        return self.encode(format_result(result))

    def _count(self, key: str) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def take_counts(self) -> dict[str, int]:
        """The counts since the last take (one generate call's), reset with the turns."""
        with self.lock:
            counts, self.counts, self.turns = self.counts, {}, {}
        return counts
