"""Tools: the calculator is exact and refuses non-arithmetic; the Hermes parser; the YAML tool config; the python
sandbox contains an infinite loop, a 10 GB allocation, a fork bomb, writes outside its directory and reads of the
parent's environment, while returning ordinary output."""
import os
from fractions import Fraction

import pytest

from rlhf_mcore.agents import ToolConfigError, load_tool_config, parse_tool_calls
from rlhf_mcore.agents.calculator import CalculatorError, evaluate, format_number
from rlhf_mcore.agents.hermes import CallError, ToolCall
from rlhf_mcore.agents.sandbox import run_python


def test_calculator_is_exact():
    assert format_number(evaluate("123456 * 654321")) == str(123456 * 654321)
    assert evaluate("0.1 + 0.2") == Fraction(3, 10)
    assert format_number(evaluate("1/8")) == "0.125" and format_number(evaluate("-7/4")) == "-1.75"
    assert format_number(evaluate("1/3")).startswith("1/3")
    assert format_number(evaluate("(2 ^ 10) // 3 % 7")) == str((2 ** 10) // 3 % 7)


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "x + 1", "[1, 2]", "1,2", "2 ** 100000",
                                  "1 / 0", "'a' * 3", "(lambda: 1)()", ""])
def test_calculator_refuses(expr):
    with pytest.raises(CalculatorError):
        evaluate(expr)


def test_hermes_parser():
    text = ('Let me.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            '<tool_call>["calculator"]</tool_call><tool_call>{"name": "x"')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "1+1"})
    assert calls[1] == ToolCall("python", {"code": "print(1)"})
    assert isinstance(calls[2], CallError) and "not valid JSON" in calls[2].error
    assert isinstance(calls[3], CallError) and "JSON object" in calls[3].error
    assert isinstance(calls[4], CallError) and "not closed" in calls[4].error
    assert parse_tool_calls("#### 42") == []


def test_tool_config(tmp_path):
    good = tmp_path / "tools.yaml"
    good.write_text("tools:\n  - name: calculator\n  - name: python\n    config: {timeout_s: 3}\n"
                    "  - class_name: rlhf_mcore.agents.calculator.Calculator\n    tool_schema:\n"
                    "      type: function\n      function: {name: calc2, description: d, parameters: {type: object}}\n")
    tools = load_tool_config(good)
    assert sorted(tools) == ["calc2", "calculator", "python"]
    assert tools["calc2"].schema()["function"]["name"] == "calc2" and tools["calc2"](expression="2*3") == "6"
    bad = tmp_path / "bad.yaml"
    for text, words in (("tools:\n  - name: nope\n", "nope"), ("tools:\n  - {}\n", "needs `name`"),
                        ("tools:\n  - name: calculator\n  - name: calculator\n", "unique"),
                        ("tools:\n  - class_name: no.such.Thing\n", "cannot be imported"), ("tools: 3\n", "tools:")):
        bad.write_text(text)
        with pytest.raises(ToolConfigError, match=words):
            load_tool_config(bad)
    with pytest.raises(ToolConfigError, match="no such file"):
        load_tool_config(tmp_path / "missing.yaml")


def test_python_sandbox_runs_code():
    r = run_python("import json\nprint(json.dumps({'a': 6 * 7}))\nopen('x.txt', 'w').write('ok')\n"
                   "print(open('x.txt').read())", timeout_s=20)
    assert r["stdout"] == '{"a": 42}\nok\n' and r["exit_code"] == 0 and not r["timed_out"]


def test_python_sandbox_contains_infinite_loop():
    r = run_python("while True:\n    pass", timeout_s=20, cpu_s=1)
    assert r["exit_code"] != 0 and "CPU time limit" in r["stderr"] and r["seconds"] < 10
    r = run_python("import time\ntime.sleep(60)", timeout_s=1)  # sleeping uses no CPU: the wall clock ends it
    assert r["timed_out"] and r["seconds"] < 5


def test_python_sandbox_contains_memory_fork_and_output():
    r = run_python("x = bytearray(10 * 1024 ** 3)\nprint('allocated')", timeout_s=20, memory_mb=512)
    assert "MemoryError" in r["stderr"] and "allocated" not in r["stdout"]
    r = run_python("import os\nwhile True:\n    os.fork()", timeout_s=20)
    assert r["exit_code"] != 0 and "not allowed" in r["stderr"]
    r = run_python("import subprocess\nsubprocess.run(['true'])", timeout_s=20)
    assert "not allowed" in r["stderr"]
    r = run_python("while True:\n    print('x' * 1000)", timeout_s=20, max_output_chars=1000)
    assert len(r["stdout"]) < 1100 and "truncated" in r["stdout"] and r["seconds"] < 10


def test_python_sandbox_contains_files_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_TEST_SECRET", "hunter2")
    target = tmp_path / "escape.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')", timeout_s=20)
    assert not target.exists() and "not allowed" in r["stderr"]
    r = run_python("import os\nprint(sorted(os.environ))", timeout_s=20)
    assert "RLHF_TEST_SECRET" not in r["stdout"] and "hunter2" not in r["stdout"] and "PATH" in r["stdout"]
    r = run_python(f"print(open('/proc/{os.getpid()}/environ').read())", timeout_s=20)
    assert "hunter2" not in r["stdout"] and "not allowed" in r["stderr"]
    assert os.environ["RLHF_TEST_SECRET"] == "hunter2"  # the trainer's process is untouched
