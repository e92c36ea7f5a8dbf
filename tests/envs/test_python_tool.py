"""PythonTool: parsing calls, answering turns, and running code through the real sandbox.

The sandbox cases all run in one thread pool at once (one environment per episode), each
checked against the exact observation a lone run gives: episodes stepped concurrently must not
see each other's output, and the tool's errors must be observations.
"""

import json
import os
import secrets
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from delta_jax.envs import Environment, PythonTool, StepResult, parse_fenced_call, parse_tool_call
from delta_jax.rewards.code import OUTPUT_CUT
from tests.envs.helpers import word_tokenizer


def call(code, name="python"):
    body = json.dumps({"name": name, "arguments": {"code": code}})
    return f"<tool_call>\n{body}\n</tool_call>"


def fenced(code):
    return f"Let me run it.\n```python\n{code}\n```\n"


# ---------------------------------------------------------------------------------- parsing


def test_parse_tool_call_accepts_the_qwen3_forms():
    assert parse_tool_call(call("print(1)")).code == "print(1)"
    as_string = (
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"x = 1\\"}"}</tool_call>'
    )
    assert parse_tool_call(as_string).code == "x = 1"
    # A raw line break inside the JSON string (not valid strict JSON, common in model output).
    raw = '<tool_call>{"name": "python", "arguments": {"code": "a = 1\nprint(a)"}}</tool_call>'
    assert parse_tool_call(raw).code == "a = 1\nprint(a)"


@pytest.mark.parametrize(
    ("turn", "error", "message"),
    [
        ('<tool_call>{"name": "python", "arguments": {</tool_call>', "bad_json", "not valid JSON"),
        ("<tool_call>print(1)</tool_call>", "bad_json", "not valid JSON"),
        (call("print(1)", name="bash"), "unknown_tool", "unknown tool 'bash'"),
        ('<tool_call>["python"]</tool_call>', "unknown_tool", "unknown tool None"),
        ('<tool_call>{"name": "python"}</tool_call>', "missing_code", "argument 'code'"),
        ('<tool_call>{"name": "python", "arguments": {"code": 3}}</tool_call>', "missing_code", ""),
        ('<tool_call>{"name": "python", "arguments": {"code": "x"}}', "unclosed", "not closed"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "bad_json", "not valid JSON"),
    ],
)
def test_parse_tool_call_errors(turn, error, message):
    parsed = parse_tool_call(turn)
    assert (parsed.code, parsed.error) == (None, error)
    assert message in parsed.message and parsed.message.startswith("Error: ")


def test_parse_tool_call_first_call_only_and_not_in_thinking():
    assert parse_tool_call("The answer is \\boxed{4}.") is None
    assert parse_tool_call(call("print(1)") + "\n" + call("print(2)")).code == "print(1)"
    thought = "<think>maybe " + call("print(0)") + "? no.</think>\n\n"
    assert parse_tool_call(thought + "It is 4.") is None
    assert parse_tool_call(thought + call("print(5)")).code == "print(5)"


def test_parse_fenced_call():
    assert parse_fenced_call(fenced("print(1)")).code == "print(1)\n"
    assert parse_fenced_call("```py\nx = 1\n```").code == "x = 1\n"
    assert parse_fenced_call("```Python3\n```\n").code == ""
    # A fence inside the code does not close the block; only one that starts a line does.
    assert parse_fenced_call("```python\nprint('```')\n```\n").code == "print('```')\n"
    assert parse_fenced_call(fenced("a = 1") + fenced("a = 2")).code == "a = 1\n"
    assert parse_fenced_call("```\nprint(1)\n```\n") is None  # Not marked as python.
    assert parse_fenced_call("no code here") is None
    assert parse_fenced_call("```python\nprint(1)\n").error == "unclosed"


# ------------------------------------------------------------------ steps without running code


def test_protocol_and_formats():
    env = PythonTool()
    assert isinstance(env, Environment)
    assert env.stop_strings == ("</tool_call>",)
    assert env.tools[0]["function"]["name"] == "python"
    base = PythonTool(call_format="fenced")
    assert base.stop_strings == ("\n```\n",) and base.tools == ()
    # The stop string ends a turn right after the call it closes.
    turn = fenced("print(1)")
    assert turn.endswith(base.stop_strings[0]) and turn.count(base.stop_strings[0]) == 1


def test_final_answer_ends_the_episode_unscored():
    env = PythonTool()
    assert env.reset({"prompt": "What is 6 * 7?", "answer": "42"}) == "What is 6 * 7?"
    result = env.step("<think>easy</think>\n\nThe answer is \\boxed{42}.")
    assert result == StepResult(None, True, None, {"tool_call": False, "error": None, "exec": None})


def test_malformed_calls_are_observations_and_count_towards_the_limit():
    env = PythonTool(max_tool_calls=2)
    env.reset({"prompt": "q"})
    for _ in range(2):
        result = env.step("<tool_call>{oops}</tool_call>")
        assert (result.done, result.reward, result.info["error"]) == (False, None, "bad_json")
        assert result.observation.startswith("Error: the tool call is not valid JSON")
    result = env.step("<tool_call>{oops}</tool_call>")
    assert (result.observation, result.done, result.info["error"]) == (
        None,
        True,
        "too_many_calls",
    )
    assert env.tool_calls == 2
    env.reset({"prompt": "again"})  # A new episode starts its count again.
    assert env.tool_calls == 0 and not env.step("<tool_call>{oops}</tool_call>").done
    assert PythonTool(max_tool_calls=0).step(call("print(1)")).done


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="call_format"):
        PythonTool(call_format="xml")
    with pytest.raises(ValueError, match="max_tool_calls"):
        PythonTool(max_tool_calls=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        PythonTool(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        PythonTool(memory_mb=8)
    with pytest.raises(ValueError, match="no text field 'question'"):
        PythonTool(prompt_key="question").reset({"prompt": "q"})


# --------------------------------------------------------------------- through the sandbox

SECRET = f"dj-secret-{secrets.token_hex(8)}"
WORDS = [f"w{i}" for i in range(200)]
LINES = "\n".join(f"line {i}" for i in range(5000))
NETWORK = (
    "import socket\ntry:\n"
    "    socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')\n"
    "    print('connected')\nexcept OSError:\n    print('blocked')\n"
)


def _cases(port):
    """name -> (PythonTool arguments, the turn that calls the tool)."""
    return {
        "print": ({}, call("print(6 * 7)")),
        "fenced": (
            {"call_format": "fenced"},
            fenced("import sys\nprint('out')\nprint('err', file=sys.stderr)"),
        ),
        "exception": ({}, call("print('before')\n1 / 0")),
        "exit_code": ({}, call("import sys\nsys.exit(3)")),
        "silent": ({}, call("x = 1")),
        "secret": ({}, call("import os\nprint(os.environ.get('DJ_TEST_SECRET'))")),
        "network": ({}, call(NETWORK.format(port=port))),
        "hang": ({"timeout_s": 1}, call("print('started', flush=True)\nwhile True:\n    pass")),
        "memory": ({"memory_mb": 256}, call("x = bytearray(2 * 1024 ** 3)")),
        # A lone surrogate is valid in a JSON string but not in a source file.
        "surrogate": (
            {},
            '<tool_call>{"name": "python", "arguments": {"code": "\\ud800"}}</tool_call>',
        ),
        "long_chars": ({"max_observation_tokens": 200}, call(f"print({LINES!r})")),
        "long_tokens": (
            {"max_observation_tokens": 24, "tokenizer": word_tokenizer()},
            call(f"print({' '.join(WORDS)!r})"),
        ),
    }


@pytest.fixture(scope="module")
def episodes():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0)
    os.environ["DJ_TEST_SECRET"] = SECRET
    try:
        cases = _cases(server.getsockname()[1])

        def episode(name):
            kwargs, turn = cases[name]
            env = PythonTool(**kwargs)
            env.reset({"prompt": "q"})
            return env.step(turn), env.step("The answer is \\boxed{42}."), env.tool_calls

        with ThreadPoolExecutor(max_workers=len(cases)) as pool:
            results = dict(zip(cases, pool.map(episode, cases), strict=True))
        try:
            server.accept()
            reached = True
        except BlockingIOError:
            reached = False
    finally:
        del os.environ["DJ_TEST_SECRET"]
        server.close()
    return results, reached


def observation(episodes, name):
    first, final, calls = episodes[0][name]
    assert (first.done, first.reward, first.info["tool_call"], calls) == (False, None, True, 1)
    assert (final.observation, final.done, final.reward) == (None, True, None)
    return first.observation, first.info


def test_output_is_the_observation(episodes):
    assert observation(episodes, "print") == (
        "42",
        {"tool_call": True, "error": None, "exec": episodes[0]["print"][0].info["exec"]},
    )
    assert observation(episodes, "fenced")[0] == "out\nerr"
    assert observation(episodes, "silent")[0] == "[no output]"


def test_failures_are_observations(episodes):
    text, info = observation(episodes, "exception")
    # The temp dir's random name is not in it: the same code gives the same observation.
    assert text.startswith('before\nTraceback (most recent call last):\n  File "./solution.py", ')
    assert text.endswith("\nZeroDivisionError: division by zero\n[exit code 1]")
    assert info["error"] == "runtime_error" and info["exec"].exit_code == 1
    assert observation(episodes, "exit_code")[0] == "[exit code 3]"
    text, info = observation(episodes, "hang")
    assert (text, info["error"]) == ("started\n[timed out after 1 s]", "timeout")
    text, info = observation(episodes, "memory")
    assert text.endswith("MemoryError\n[memory limit of 256 MB exceeded]")
    assert info["error"] == "memory_limit"
    text, info = observation(episodes, "surrogate")
    assert "SyntaxError" in text and info["error"] == "syntax_error"


def test_no_secrets_and_no_network(episodes):
    assert observation(episodes, "secret")[0] == "None"
    text, info = observation(episodes, "network")
    if info["exec"].network_isolated:
        assert text == "blocked" and not episodes[1]
    else:  # The OS refused the namespace; the sandbox's own tests cover the warning.
        assert text == "connected"


def test_long_output_keeps_exact_head_and_tail(episodes):
    keep = 200 - len(OUTPUT_CUT)
    expected = LINES[: keep // 2] + OUTPUT_CUT + LINES[-(keep - keep // 2) :]
    assert observation(episodes, "long_chars")[0] == expected
    # 24 tokens: the marker's 4, then the first 10 and the last 10 words.
    text = observation(episodes, "long_tokens")[0]
    assert text == " ".join(WORDS[:10]) + OUTPUT_CUT + " ".join(WORDS[-10:])
