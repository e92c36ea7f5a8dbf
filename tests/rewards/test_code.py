"""Sandboxed code execution: correct code passes, and every escape attempt is stopped."""

import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from delta_jax.rewards import CodeResult, ExecResult, execute, extract_code, run_code
from delta_jax.rewards.code import _BOOT, OUTPUT_CUT
from tests.rewards.helpers import sandbox_processes

DOUBLE = json.dumps({"inputs": ["3\n", "5"], "outputs": ["6", "10\n"]})


def test_correct_code_passes_stdio_tests():
    result = run_code("print(int(input()) * 2)", DOUBLE, timeout_s=5)
    assert isinstance(result, CodeResult)
    assert (result.passed, result.reason, result.num_tests, result.num_passed) == (
        True,
        "passed",
        2,
        2,
    )


def test_mapping_tests_multiline_inputs_and_float_tolerance():
    tests = {"inputs": [["2", "1 2"]], "outputs": [["1.5000000001"]]}
    code = "input()\na, b = map(int, input().split())\nprint((a + b) / 2)"
    assert run_code(code, tests, timeout_s=5).passed


def test_wrong_code_fails():
    result = run_code("print(int(input()) * 3)", DOUBLE, timeout_s=5)
    assert (result.passed, result.reason, result.num_passed) == (False, "wrong_answer", 0)


def test_crashing_and_invalid_code_fail_with_reason():
    assert run_code("raise RuntimeError('x')", DOUBLE, timeout_s=5).reason == "runtime_error"
    assert run_code("def f(:\n  pass", DOUBLE, timeout_s=5).reason == "syntax_error"


def test_assert_script_form():
    code = "def add(a, b):\n    return a + b\n"
    assert run_code(code, "assert add(1, 2) == 3\nassert add(-1, 1) == 0", timeout_s=5).passed
    wrong = run_code(code, "assert add(1, 2) == 4", timeout_s=5)
    assert (wrong.passed, wrong.reason) == (False, "runtime_error")
    # Exiting 0 before the tests run must not count as passing them.
    cheat = run_code("import sys\nsys.exit(0)\n" + code, "assert add(1, 2) == 4", timeout_s=5)
    assert (cheat.passed, cheat.reason) == (False, "tests_not_run")


def test_infinite_loop_is_cut_at_the_timeout():
    start = time.monotonic()
    result = run_code("while True:\n    pass", DOUBLE, timeout_s=1.5)
    elapsed = time.monotonic() - start
    assert (result.passed, result.reason) == (False, "timeout")
    assert 1.5 <= elapsed < 1.5 + 5.0
    assert sandbox_processes() == []


def test_memory_bomb_is_stopped():
    code = "x = []\nwhile True:\n    x.append(bytearray(50 * 1024 * 1024))"
    result = run_code(code, DOUBLE, timeout_s=10, memory_mb=256)
    assert (result.passed, result.reason) == (False, "memory_limit")


def test_fork_bomb_is_contained_and_cleaned_up():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    result = run_code(code, DOUBLE, timeout_s=2, max_procs=16)
    assert not result.passed
    assert result.reason in ("timeout", "runtime_error")
    assert time.monotonic() - start < 2 + 5.0
    assert sandbox_processes() == []


def test_detached_child_does_not_outlive_the_run():
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
        "print(int(input()) * 2)"
    )
    run_code(code, DOUBLE, timeout_s=5)
    assert sandbox_processes() == []


def test_output_flood_is_capped():
    result = run_code("while True:\n    print('x' * 1000)", DOUBLE, timeout_s=5, file_size_mb=1)
    assert (result.passed, result.reason) == (False, "output_limit")


def test_writing_outside_the_temp_dir_is_contained(tmp_path):
    tag = secrets.token_hex(6)
    targets = [f"/tmp/dj_escape_{tag}", f"/dev/shm/dj_escape_{tag}", f"/var/tmp/dj_escape_{tag}"]
    tmp_path.chmod(0o777)  # Even a world-writable directory of the host is out of reach.
    targets.append(str(tmp_path / "escape"))
    code = (
        f"written = 0\nfor path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n"
        "        written += 1\n    except OSError:\n        pass\n"
        "open('inside.txt', 'w').write('ok')\n"  # The temp dir itself is writable...
        "assert open('inside.txt').read() == 'ok'\n"
        "print(int(input()) * 2 + written)\n"  # ...and any successful escape fails the test.
    )
    result = run_code(code, DOUBLE, timeout_s=5)
    assert [t for t in targets if os.path.exists(t)] == []
    assert result.fs_isolated
    assert result.passed  # Every write outside failed, the one inside worked.


def test_writing_outside_without_mount_namespace_is_detected_and_removed(caplog):
    path = f"/tmp/dj_escape_{secrets.token_hex(6)}"
    code = f"open({path!r}, 'w').write('x')\nprint(int(input()) * 2)"
    with caplog.at_level(logging.WARNING, logger="delta_jax.rewards.code"):
        result = run_code(code, DOUBLE, timeout_s=5, namespaces=False)
    assert (result.passed, result.reason) == (False, "wrote_outside_sandbox")
    assert not os.path.exists(path)
    assert not (result.network_isolated or result.fs_isolated or result.pid_isolated)


def test_parent_secret_is_not_readable(monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("DJ_TEST_SECRET", secret)
    code = (
        "import os, glob\nfound = os.environ.get('DJ_TEST_SECRET', '')\n"
        "for path in glob.glob('/proc/*/environ'):\n    try:\n"
        "        for kv in open(path, 'rb').read().split(b'\\0'):\n"
        "            if kv.startswith(b'DJ_TEST_SECRET='):\n"
        "                found = kv.split(b'=', 1)[1].decode()\n"
        "    except OSError:\n        pass\nprint(found or 'none')\n"
    )
    tests = {"inputs": [""], "outputs": [secret]}
    result = run_code(code, tests, timeout_s=5)
    assert (result.passed, result.reason) == (False, "wrong_answer")
    assert secret not in result.stdout and result.stdout.strip() == "none"
    # Without namespaces, the scrubbed environment and the other uid still keep it out.
    degraded = run_code(code, tests, timeout_s=5, namespaces=False)
    assert (degraded.passed, degraded.stdout.strip()) == (False, "none")


@pytest.fixture
def listening_server():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    connections = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            connections.append(conn.recv(64))
            conn.sendall(b"pong\n")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], connections
    stop.set()
    thread.join()
    server.close()


def test_network_connection_is_blocked(listening_server, caplog):
    port, connections = listening_server
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "s.sendall(b'ping')\nprint(s.recv(64).decode().strip())\n"
    )
    tests = {"inputs": [""], "outputs": ["pong"]}
    # Control: the server answers an ordinary client, so a blocked connection means isolation.
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"control")
        assert s.recv(64) == b"pong\n"
    with caplog.at_level(logging.WARNING, logger="delta_jax.rewards.code"):
        result = run_code(code, tests, timeout_s=5)
    if result.network_isolated:
        assert (result.passed, result.reason) == (False, "runtime_error")
        assert connections == [b"control"]
    else:  # The OS refused the namespace: it must say so.
        assert "network_isolated" in caplog.text


def test_extract_code_takes_the_last_block():
    response = "try:\n```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\n"
    assert extract_code(response) == "print(2)\n"
    assert extract_code("no code") is None


@pytest.mark.parametrize(
    ("tests", "match"),
    [
        ({"inputs": ["1"], "outputs": []}, "as many inputs as outputs"),
        ({"inputs": ["1"]}, "'inputs' and 'outputs'"),
        ({"inputs": ["1"], "outputs": ["1"], "fn_name": "f"}, "call-based"),
        (3, "a string or a mapping"),
    ],
)
def test_bad_tests_raise(tests, match):
    with pytest.raises(ValueError, match=match):
        run_code("print(1)", tests)


def test_bad_limits_raise():
    with pytest.raises(ValueError, match="timeout_s"):
        run_code("print(1)", DOUBLE, timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_code("print(1)", DOUBLE, memory_mb=8)


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
    reason="needs root (to become another user) and a system python3 that user can run",
)
def test_unprivileged_bootstrap_isolates_through_a_user_namespace():
    # run_code started by an unprivileged user: the bootstrap gets its namespaces from a user
    # namespace instead of root's privileges.
    workdir = Path(tempfile.mkdtemp(prefix="dj-test-"))  # /tmp is traversable by `nobody`.
    os.chown(workdir, 65534, 65534)
    program = workdir / "solution.py"
    escape = f"/tmp/dj_escape_{secrets.token_hex(6)}"
    program.write_text(
        "import socket\nx = int(input())\n"
        "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n    x += 100\n"
        "except OSError:\n    pass\n"
        f"try:\n    open({escape!r}, 'w').write('x')\n    x += 1000\nexcept OSError:\n    pass\n"
        "print(x * 2)\n"
    )
    program.chmod(0o644)
    # The unprivileged user runs its own readable copy of the bootstrap: the checkout may sit in
    # a directory `nobody` cannot enter (e.g. `mktemp -d`, mode 700).
    boot = workdir / "boot.py"
    shutil.copyfile(_BOOT, boot)
    boot.chmod(0o644)
    job = {
        "program": str(program),
        "cases": [{"stdin": "3", "expected": "6"}],
        "timeout_s": 5.0,
        "memory_mb": 512,
        "file_size_mb": 4,
        "max_procs": 32,
        "max_files": 64,
        "float_tol": 1e-6,
        "uid": None,
        "python_prefix": "/usr",
        "namespaces": True,
    }
    try:
        proc = subprocess.run(
            ["/usr/bin/python3", "-I", "-S", str(boot)],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            cwd=workdir,
            user=65534,
            group=65534,
            extra_groups=[],
            env={"PATH": "/usr/bin:/bin"},
            timeout=30,
        )
    finally:
        shutil.rmtree(workdir)
    out = json.loads(proc.stdout)
    iso = out["isolation"]
    assert not os.path.exists(escape)
    if iso["network_isolated"] and iso["fs_isolated"]:
        assert out["verdict"] == "passed", out
    else:  # The kernel refuses unprivileged user namespaces here: it must be reported.
        assert any(k in n for n in iso["notes"] for k in ("unshare", "mount", "read-only")), out


def test_planted_symlinks_do_not_redirect_the_sandbox_files():
    # Without namespaces the bootstrap is root on the host: a link the program leaves in its
    # directory, where the next case's files go, must not make it write elsewhere.
    fd, target = tempfile.mkstemp(prefix="dj-target-")
    os.write(fd, b"original")
    os.close(fd)
    code = (
        "import os\nfor name in ('.in1', '.out1', '.err1'):\n"
        f"    os.symlink({target!r}, name)\nprint(int(input()) * 2)\n"
    )
    try:
        result = run_code(code, DOUBLE, timeout_s=5, namespaces=False)
        assert Path(target).read_bytes() == b"original"
    finally:
        os.unlink(target)
    # os.symlink fails on the second case (the links exist): the run fails, nothing escapes.
    assert not result.passed


def test_execute_reports_both_ends_of_a_long_output():
    # 3 MB on stdout, past the 1 MiB the bootstrap reads for the tests: the tail comes from the
    # end of the file. stdin reaches the program; the exit code and stderr come back.
    code = (
        "import sys\nsys.stdout.write(input() + 'x' * 3_000_000 + 'END')\n"
        "sys.stderr.write('warn')\nsys.exit(2)\n"
    )
    result = execute(code, stdin="START\n", output_window_bytes=16, timeout_s=10)
    assert isinstance(result, ExecResult)
    assert result.stdout == "START" + "xxx" + OUTPUT_CUT + "xxxxxEND"
    assert (result.stderr, result.exit_code, result.reason) == ("warn", 2, "runtime_error")
    assert execute("print('ok')").stdout == "ok\n"
    with pytest.raises(ValueError, match="output_window_bytes"):
        execute("pass", output_window_bytes=1)
