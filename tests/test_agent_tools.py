"""Tools: the calculator is exact and refuses non-arithmetic; the Hermes parser; the YAML tool config; the python
sandbox contains an infinite loop, a 10 GB allocation, a fork bomb, writes outside its directory and reads of the
parent's environment, while returning ordinary output; run as root it drops to `nobody`, and where it cannot it
refuses (unless `allow_root: true`) with a message to the model, a counted error and one warning line."""
import json
import os
import sys
from fractions import Fraction

import pytest

from rlhf_mcore.agents import ToolConfigError, load_tool_config, parse_tool_calls
from rlhf_mcore.agents.calculator import CalculatorError, evaluate, format_number
from rlhf_mcore.agents.hermes import CallError, ToolCall
from rlhf_mcore.agents.sandbox import PythonSandbox, SandboxRefused, privilege_problem, run_python


def _sandbox_python() -> str:
    """An interpreter the sandbox can drop privileges with: the trainer's, or (run as root where `nobody` cannot
    execute it, e.g. Python under /root) the system's. Else the trainer's: the sandbox tests then fail, refused."""
    for python in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(python) and privilege_problem(python) is None:
            return python
    return sys.executable


PY = _sandbox_python()


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
                   "print(open('x.txt').read())", timeout_s=20, python=PY)
    assert r["stdout"] == '{"a": 42}\nok\n' and r["exit_code"] == 0 and not r["timed_out"]


def test_python_sandbox_contains_infinite_loop():
    r = run_python("while True:\n    pass", timeout_s=20, cpu_s=1, python=PY)
    assert r["exit_code"] != 0 and "CPU time limit" in r["stderr"] and r["seconds"] < 10
    r = run_python("import time\ntime.sleep(60)", timeout_s=1, python=PY)  # no CPU used: the wall clock ends it
    assert r["timed_out"] and r["seconds"] < 5


def test_python_sandbox_contains_memory_fork_and_output():
    r = run_python("x = bytearray(10 * 1024 ** 3)\nprint('allocated')", timeout_s=20, memory_mb=512, python=PY)
    assert "MemoryError" in r["stderr"] and "allocated" not in r["stdout"]
    r = run_python("import os\nwhile True:\n    os.fork()", timeout_s=20, python=PY)
    assert r["exit_code"] != 0 and "not allowed" in r["stderr"]
    r = run_python("import subprocess\nsubprocess.run(['true'])", timeout_s=20, python=PY)
    assert "not allowed" in r["stderr"]
    r = run_python("while True:\n    print('x' * 1000)", timeout_s=20, max_output_chars=1000, python=PY)
    assert len(r["stdout"]) < 1100 and "truncated" in r["stdout"] and r["seconds"] < 10


def test_python_sandbox_contains_files_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_TEST_SECRET", "hunter2")
    target = tmp_path / "escape.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')", timeout_s=20, python=PY)
    assert not target.exists() and "not allowed" in r["stderr"]
    r = run_python("import os\nprint(sorted(os.environ))", timeout_s=20, python=PY)
    assert "RLHF_TEST_SECRET" not in r["stdout"] and "hunter2" not in r["stdout"] and "PATH" in r["stdout"]
    r = run_python(f"print(open('/proc/{os.getpid()}/environ').read())", timeout_s=20, python=PY)
    assert "hunter2" not in r["stdout"] and "not allowed" in r["stderr"]
    assert os.environ["RLHF_TEST_SECRET"] == "hunter2"  # the trainer's process is untouched


def test_python_sandbox_drops_to_nobody_when_possible():
    """Run as root (with an interpreter `nobody` can execute) the code runs as uid 65534; run as anyone else, as
    that user, not refused. Mutation: `_can_drop_to_nobody` returns False -> as root the call is refused (fails)."""
    r = run_python("import os\nprint(os.getuid(), os.getgid())", timeout_s=20, python=PY)
    want = "65534 65534" if os.geteuid() == 0 else f"{os.getuid()} {os.getgid()}"
    assert r["stdout"].strip() == want and r["exit_code"] == 0, r


def test_python_sandbox_refuses_to_stay_root(tmp_path, monkeypatch, capfd, tiny_model_dir):
    """An interpreter `nobody` cannot execute (a link to ours in a 0700 directory) under root: the tool warns once
    when built (naming the fixes), refuses every call (the model reads why; `agent/tool_exceptions` counts it) and
    runs nothing; `allow_root: true` runs the code as root; a non-boolean `allow_root` is a config error. Not root
    here: the process is made to look like root (the probe then fails as it would: no setuid possible).
    Mutation: drop the `raise SandboxRefused` in run_python -> the code runs (fails)."""
    from agent_helpers import ScriptedEngine, fixture_tokenizer

    from rlhf_mcore.agents import AgentRunner, MultiTurnSettings
    from rlhf_mcore.agents.rollout import agent_metrics, trajectory_info
    from rlhf_mcore.agents.runner import TURN_KEY
    from rlhf_mcore.rollout.base import SamplingParams

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link = private / "python3"
    link.symlink_to(sys.executable)
    uid = os.getuid()
    monkeypatch.setattr("rlhf_mcore.agents.sandbox.os.geteuid", lambda: 0)
    marker = tmp_path / "RAN"
    code = f"open({str(marker)!r}, 'w').close()"  # outside the working directory: as root, the audit hook refuses

    capfd.readouterr()
    tool = PythonSandbox(timeout_s=20, python=str(link))
    warning = [x for x in capfd.readouterr().err.splitlines() if x.strip()]
    assert len(warning) == 1 and warning[0].startswith("warning: the python sandbox runs as root") and \
        str(link) in warning[0] and "allow_root: true" in warning[0] and "refuses every call" in warning[0], warning
    with pytest.raises(SandboxRefused, match="refused to run the code: .*cannot drop to user nobody"):
        tool(code="print(1)")

    tok, end = fixture_tokenizer(tiny_model_dir("qwen2"), "qwen2")
    call = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"
    engine = ScriptedEngine(tok, end, lambda rid, prompt: call if rid % TURN_KEY == 0 else "#### 1", streaming=False)
    runner = AgentRunner(engine, tok, MultiTurnSettings(tool_timeout_s=30), {"python": tool})
    msgs = [{"role": "user", "content": "go"}]
    ids = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    rows = [{"raw_prompt": msgs, "agent_name": "tool_agent", "index": 0}]
    traj = runner.run([ids], rows, SamplingParams(n=1, max_new_tokens=4000, seed=0))[0][0]
    reply = tok.decode(traj.response_ids[traj.turns[1]["start"]:traj.turns[1]["end"]])
    assert "SandboxRefused: refused to run the code" in reply and "allow_root: true" in reply, reply
    assert agent_metrics([trajectory_info(traj)])["agent/tool_exceptions"] == 1
    assert not marker.exists()

    capfd.readouterr()
    opted = PythonSandbox(timeout_s=20, python=str(link), allow_root=True)
    assert "runs model-written code as root (allow_root: true)" in capfd.readouterr().err
    assert opted(code="import os\nprint(os.getuid())").strip() == str(uid)  # root here when the suite runs as root
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - name: python\n    config: {allow_root: 'yes'}\n")
    with pytest.raises(ToolConfigError, match="allow_root='yes': give true or false"):
        load_tool_config(bad)
