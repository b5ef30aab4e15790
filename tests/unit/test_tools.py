"""Agentic tools (issue 16): finding a call at the end of the model's text, the safe calculator, the python tool's
limits, user tools by import path, and the toolbox that turns every failure into text for the model."""

import time

import pytest

from m2flow.reasoning.tasks.tools import (MAX_RESULT_CHARS, AgentHook, ToolCall, ToolResult, Toolbox, calc,
                                              find_call, format_result, run_python)


def test_find_call_takes_the_complete_call_that_ends_the_text():
    call = find_call("What is 123*45? <calc>123*45</calc>", ["calc"])
    assert call == ToolCall("calc", "123*45", len("What is 123*45? <calc>123*45</calc>"))
    # the last of several, trailing space allowed
    assert find_call("<calc>1+1</calc><result>2</result> so <calc>2*3</calc>  ", ["calc"]).text == "2*3"
    assert find_call("<calc>1+1", ["calc"]) is None  # not closed yet
    assert find_call("<calc>1+1</calc> and more", ["calc"]) is None  # the text goes on after it
    assert find_call("<python>print(1)</python>", ["calc"]) is None  # not a tool of this run
    assert find_call("</calc>", ["calc"]) is None  # a closing tag with no opening one


@pytest.mark.parametrize("expr, value", [
    ("123*45", "5535"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-7 + 2", "-5"), ("7/2", "3.5"), ("8/2", "4"),
    ("7//2", "3"), ("7 % 3", "1"), ("2**10", "1024"), ("1/3", "0.333333333333"), ("99999999999*99999999999",
                                                                                    "9999999999800000000001"),
    ("1.5*2", "3"),
])
def test_calc_is_exact_arithmetic(expr, value):
    assert calc(expr) == value


@pytest.mark.parametrize("expr, reason", [
    ("__import__('os').system('ls')", "not allowed"), ("open('x')", "not allowed"), ("a+1", "not allowed"),
    ("'ab'*3", "not allowed"), ("1/0", "division by zero"), ("9**9**9", "exponent"), ("10**39*10**39", "too large"),
    ("", "empty"), ("1+", "not an arithmetic expression"), ("1" * 300, "longer than"), ("(-8)**0.5", "real"),
    ("[1, 2]", "not allowed"),
])
def test_calc_refuses_what_is_not_bounded_arithmetic(expr, reason):
    start = time.monotonic()
    with pytest.raises(ValueError, match=reason):
        calc(expr)
    assert time.monotonic() - start < 1.0  # no expression makes it compute for long


def test_python_tool_returns_stdout_and_reports_errors():
    assert run_python("print(sum(range(10)))") == "45"
    with pytest.raises(ValueError, match="ZeroDivisionError"):
        run_python("1/0")


def test_python_tool_is_cut_at_its_timeout_and_has_no_network_or_subprocesses():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="1 s"):
        run_python("while True: pass", timeout_s=1.0)
    assert time.monotonic() - start < 5.0
    with pytest.raises(ValueError, match="no network"):
        run_python("import socket; socket.create_connection(('127.0.0.1', 80))")
    with pytest.raises(ValueError, match="cannot start processes"):
        run_python("import subprocess; subprocess.run(['ls'])")
    with pytest.raises(ValueError, match="MemoryError"):
        run_python("x = bytearray(512 * 1024 * 1024)", memory_mb=128)


def upper_tool(text):  # a user tool, imported by path in its own process
    return text.upper()


def sleepy_tool(text):
    time.sleep(60)
    return text


def count_tool(text):
    return len(text)  # not text: the model is told


def test_toolbox_runs_each_tool_and_never_raises_for_what_a_tool_does():
    box = Toolbox({"calc": "calc", "py": "python", "up": "test_tools:upper_tool", "slow": "test_tools:sleepy_tool",
                   "count": "test_tools:count_tool"}, timeout_s=2.0)
    assert box.names == ["calc", "py", "up", "slow", "count"]
    assert box.run(ToolCall("calc", "12*12", 0)) == ToolResult("144", "ok")
    assert box.run(ToolCall("py", "print(2**5)", 0)) == ToolResult("32", "ok")
    assert box.run(ToolCall("up", "abc", 0)) == ToolResult("ABC", "ok")
    assert box.run(ToolCall("calc", "1/0", 0)) == ToolResult("error: division by zero", "error")
    assert box.run(ToolCall("nope", "1", 0)).status == "unknown"
    start = time.monotonic()
    hung = box.run(ToolCall("slow", "x", 0))
    assert hung.status == "timeout" and hung.text.startswith("error: timed out") and time.monotonic() - start < 10
    wrong = box.run(ToolCall("count", "abc", 0))
    assert wrong.status == "error" and "not text" in wrong.text


def test_results_go_back_in_result_tags_cut_to_length():
    assert format_result(ToolResult("5535", "ok")) == "<result>5535</result>"
    assert format_result(ToolResult("x" * 1000, "ok")) == f"<result>{'x' * MAX_RESULT_CHARS}</result>"


@pytest.mark.parametrize("tools, message", [
    ({}, "at least one tool"), ({"Calc": "calc"}, "lower-case"), ({"result": "calc"}, "not 'result'"),
    ({"t": "nomodule_xyz:fn"}, "cannot import module 'nomodule_xyz'"), ({"t": "os:no_such_fn"}, "no function"),
    ({"t": "eval"}, "an import path 'pkg.module:function'"),
])
def test_a_bad_tool_spec_fails_at_the_start_naming_it(tools, message):
    with pytest.raises((ValueError, ImportError, AttributeError), match=message):
        Toolbox(tools)


def test_agent_hook_answers_calc_at_once_and_slow_tools_later_up_to_max_turns():
    encode, decode = (lambda text: [ord(c) for c in text]), (lambda ids: "".join(map(chr, ids)))
    hook = AgentHook(Toolbox({"calc": "calc", "py": "python"}), encode, decode, max_turns=2)
    assert hook.triggers == [encode("</calc>"), encode("</py>")]
    assert hook(0, 0, encode("2+2=<calc>2+2</calc>")) == encode("<result>4</result>")  # in this process, at once
    later = hook(0, 0, encode("<py>print(6*7)</py>"))  # its own process: an answer to come
    assert hasattr(later, "done") and later.result(timeout=30) == encode("<result>42</result>")
    assert hook(0, 0, encode("<calc>1+1</calc>")) is None  # a third call of one response: over max_turns
    assert hook(0, 1, encode("no call here")) is None and hook(0, 1, encode("<calc>1/0</calc>")) == encode(
        "<result>error: division by zero</result>")
    assert hook.take_counts() == {"calls": 4, "ok": 2, "over_turns": 1, "error": 1}
    assert hook.take_counts() == {}
    hook.close()
