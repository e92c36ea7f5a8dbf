"""Code rewards: run a response's program against an item's tests in a sandboxed subprocess.

:func:`run_code` runs a program against tests (a reward); :func:`execute` runs it once and
returns its output (a tool call, :class:`delta_jax.envs.PythonTool`). Both use one sandbox.
The sandbox (``_sandbox_boot.py``, which documents each step) is a fresh Python process in its
own session with

* its own temporary directory as working directory, deleted afterwards;
* a scrubbed environment: ``PATH``, ``HOME`` (the temp dir), ``LANG`` only, so no secret of
  the parent's environment reaches it;
* new mount, network and PID namespaces where the kernel allows them: no network (127.0.0.1
  included), a read-only filesystem except the temp dir, host processes invisible, and every
  process it started killed when it ends;
* an unprivileged uid of its own when we run as root (``RLIMIT_NPROC`` does not bind root and
  counts per uid, so each concurrent sandbox gets a distinct uid); run unprivileged, it keeps
  ours;
* ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC``, ``RLIMIT_NOFILE`` and
  ``RLIMIT_CORE``;
* a wall-clock deadline, after which its whole process group is killed, then every process
  still running under its uid.

What the OS refused is reported in :class:`CodeResult` (``network_isolated``, ``fs_isolated``,
``pid_isolated``, ``notes``) and logged once as a warning.

Two test forms are accepted for ``tests``:

* stdin/stdout (Eurus2-RL-Code, APPS, CodeContests): a JSON object (or mapping)
  ``{"inputs": [...], "outputs": [...]}``; each input is fed on stdin and the output must equal
  the expected one token by token (whitespace is not significant; numbers match within
  ``float_tol`` relative);
* an assert script: plain Python appended to the code; the run passes when it exits 0 and reaches
  its end (a line printed after the tests guards against ``sys.exit(0)`` in the code).
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_BOOT = str(Path(__file__).with_name("_sandbox_boot.py"))
# The real interpreter, not a venv's link to it: its install is what the sandbox must reach.
_INTERPRETER = os.path.realpath(sys.executable)
_SETUP_GRACE_S = 5.0  # The parent's deadline: the sandbox's own one plus namespace set-up.
_UID_BASE = 1_000_000  # Far above any uid in /etc/passwd; sandbox uids are never real users.
_UIDS_PER_PROCESS = 64
_WORKDIR_PREFIX = "dj-sandbox-"
_uid_counter = itertools.count()
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
_warned: set[str] = set()
_warn_lock = threading.Lock()
_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class CodeResult:
    """Outcome of :func:`run_code`.

    Attributes:
      passed: every test passed.
      reason: ``"passed"``, ``"wrong_answer"``, ``"runtime_error"``, ``"syntax_error"``,
        ``"timeout"``, ``"memory_limit"``, ``"output_limit"``, ``"tests_not_run"``,
        ``"wrote_outside_sandbox"`` or ``"sandbox_error"``.
      num_tests: number of test cases (1 for an assert script).
      num_passed: test cases passed before the first failure.
      wall_s: wall-clock seconds of the whole run, sandbox set-up included.
      stdout: tail of the last test case's stdout.
      stderr: tail of the last test case's stderr.
      network_isolated: the program ran in a network namespace of its own.
      fs_isolated: the filesystem was read-only outside the program's temp dir.
      pid_isolated: the program ran in a PID namespace of its own.
      notes: what the OS refused, when something was.
    """

    passed: bool
    reason: str
    num_tests: int = 0
    num_passed: int = 0
    wall_s: float = 0.0
    stdout: str = ""
    stderr: str = ""
    network_isolated: bool = False
    fs_isolated: bool = False
    pid_isolated: bool = False
    notes: tuple[str, ...] = ()


def extract_code(response: str) -> str | None:
    """The last fenced code block (```python / ```py / ```) of a response, or None."""
    blocks = _CODE_BLOCK.findall(response)
    return blocks[-1] if blocks else None


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return json.dumps(value)


def _parse_tests(code: str, tests: str | Mapping[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Returns the program text and the test cases for the sandbox."""
    spec: Any = tests
    if isinstance(tests, str) and tests.lstrip().startswith("{"):
        try:
            spec = json.loads(tests)
        except json.JSONDecodeError:
            spec = tests
    if isinstance(spec, Mapping):
        if "fn_name" in spec:
            raise ValueError("tests: call-based tests (fn_name) are not supported")
        if "inputs" not in spec or "outputs" not in spec:
            raise ValueError(f"tests: expected keys 'inputs' and 'outputs', got {sorted(spec)}")
        inputs, outputs = list(spec["inputs"]), list(spec["outputs"])
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError(
                f"tests: need as many inputs as outputs (>= 1), got {len(inputs)} inputs "
                f"and {len(outputs)} outputs"
            )
        cases = [
            {"stdin": _as_text(i), "expected": _as_text(o)}
            for i, o in zip(inputs, outputs, strict=True)
        ]
        return code, cases
    if not isinstance(spec, str):
        raise ValueError(f"tests: expected a string or a mapping, got {type(tests).__name__}")
    sentinel = f"__tests_done_{secrets.token_hex(8)}__"
    program = f"{code}\n\n{spec}\n\nprint({sentinel!r})\n"
    return program, [{"stdin": "", "expected": None, "sentinel": sentinel}]


def _uid_range(pid: int) -> range:
    # Distinct across the processes of a pool (pid) and the calls of one process (counter).
    first = _UID_BASE + (pid % 1_000_000) * _UIDS_PER_PROCESS
    return range(first, first + _UIDS_PER_PROCESS)


def _next_uid() -> int:
    return _uid_range(os.getpid())[next(_uid_counter) % _UIDS_PER_PROCESS]


def _kill_uids(uids: range) -> None:
    """SIGKILLs every process running under a uid of `uids` (what escaped the process group)."""
    for _ in range(10):
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat().st_uid in uids:
                    os.kill(int(entry.name), signal.SIGKILL)
                    found = True
            except (FileNotFoundError, ProcessLookupError):
                continue
        if not found:
            return
        time.sleep(0.01)


def cleanup_sandboxes_of(pid: int) -> None:
    """Removes what the sandboxes of a killed process `pid` left: processes and temp dirs.

    A reward worker killed at its deadline dies inside :func:`run_code`, before its own
    clean-up. Its sandbox's processes die with it (parent-death signal), but not its temp dir.
    """
    if os.geteuid() == 0:
        _kill_uids(_uid_range(pid))
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_WORKDIR_PREFIX}{pid}-*")):
        shutil.rmtree(path, ignore_errors=True)


def _remove_files_of(uid: int) -> list[str]:
    """Deletes what `uid` created in the world-writable directories; returns the paths.

    Only needed without a private mount namespace: the sandbox's uid owns nothing else, so
    anything of it in ``/tmp``, ``/var/tmp`` or ``/dev/shm`` was written outside its temp dir.
    """
    removed = []
    for root in _WORLD_WRITABLE:
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
                removed.append(entry.path)
            except FileNotFoundError:
                continue
    return removed


def _warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message)


def _check_limits(timeout_s: float, memory_mb: int) -> None:
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb < 64:
        raise ValueError(f"memory_mb must be >= 64 (Python needs it to start), got {memory_mb}")


def _sandboxed(program: str, cases: list[dict[str, Any]], limits: dict[str, Any]) -> dict:
    """Runs `program` on `cases` in the sandbox: the bootstrap's result, with ``wall_s``.

    The verdict is ``"timeout"`` past the parent's deadline, ``"sandbox_error"`` when the
    bootstrap failed, and ``"wrote_outside_sandbox"`` when files of the program were found
    outside its temp dir.
    """
    start = time.monotonic()
    is_root = os.geteuid() == 0
    uid = _next_uid() if is_root else None
    workdir = tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-")
    try:
        program_path = os.path.join(workdir, "solution.py")
        # A lone surrogate (valid in a JSON string) is written as is; Python then reports the
        # invalid source as a syntax error of the program's own.
        Path(program_path).write_bytes(program.encode("utf-8", "surrogatepass"))
        os.chmod(program_path, 0o644)
        if uid is not None:
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        job = {
            "program": program_path,
            "cases": cases,
            **limits,
            "uid": uid,
            "python_prefix": sys.base_prefix,
        }
        raw = _run_boot(json.dumps(job), workdir, limits["timeout_s"] + _SETUP_GRACE_S, uid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    wall_s = time.monotonic() - start
    no_isolation = {"network_isolated": False, "fs_isolated": False, "pid_isolated": False}
    if raw is None:
        if uid is not None:
            _remove_files_of(uid)  # Isolation status unknown: clean up as if there was none.
        return {
            "verdict": "timeout",
            "num_passed": 0,
            "wall_s": wall_s,
            "isolation": {**no_isolation, "notes": []},
        }
    try:
        out = json.loads(raw)
    except json.JSONDecodeError:
        return {
            "verdict": "sandbox_error",
            "num_passed": 0,
            "stderr": raw[-2000:],
            "wall_s": wall_s,
            "isolation": {**no_isolation, "notes": []},
        }
    out["wall_s"] = wall_s
    out["workdir"] = workdir
    iso = out["isolation"]
    if not iso["fs_isolated"] and uid is not None:
        escaped = _remove_files_of(uid)
        if escaped:
            out["verdict"] = "wrote_outside_sandbox"
            iso["notes"].append("removed files written outside the temp dir: " + ", ".join(escaped))
    missing = [k for k in ("network_isolated", "fs_isolated", "pid_isolated") if not iso[k]]
    if missing:
        _warn_once(
            ",".join(missing),
            f"code sandbox: the OS refused {', '.join(missing)}; untrusted code runs with "
            f"less isolation ({'; '.join(iso['notes'])})",
        )
    return out


def _limits(
    timeout_s: float,
    memory_mb: int,
    file_size_mb: int,
    max_procs: int,
    max_files: int,
    namespaces: bool,
) -> dict[str, Any]:
    _check_limits(timeout_s, memory_mb)
    return {
        "timeout_s": float(timeout_s),
        "memory_mb": int(memory_mb),
        "file_size_mb": int(file_size_mb),
        "max_procs": int(max_procs),
        "max_files": int(max_files),
        "namespaces": bool(namespaces),
    }


def run_code(
    code: str,
    tests: str | Mapping[str, Any],
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    file_size_mb: int = 16,
    max_procs: int = 32,
    max_files: int = 64,
    float_tol: float = 1e-6,
    namespaces: bool = True,
) -> CodeResult:
    """Runs `code` against `tests` in a sandboxed subprocess (see the module docstring).

    Never raises for anything the program does: a crash, hang, bomb or escape attempt gives
    ``passed=False`` with a reason. Bad ``tests`` (the data's fault) raise ValueError.

    Args:
      code: Python source of the solution.
      tests: ``{"inputs": [...], "outputs": [...]}`` (as JSON text or a mapping) or an assert
        script (Python source run after the code).
      timeout_s: wall-clock budget of all test cases together; also the CPU-seconds limit.
      memory_mb: address-space limit of each process.
      file_size_mb: largest file (stdout included) a process may write.
      max_procs: processes the sandbox's uid may have at once (fork bombs stop here).
      max_files: open file descriptors per process.
      float_tol: relative tolerance when an output token and the expected one are numbers.
      namespaces: try the mount / network / PID namespaces; False skips them (reported like a
        refusal by the OS), e.g. where a seccomp profile makes ``unshare`` misbehave.

    Returns:
      A :class:`CodeResult`.

    Examples:
      >>> run_code("print(int(input()) * 2)", '{"inputs": ["3"], "outputs": ["6"]}').passed
      True
    """
    limits = _limits(timeout_s, memory_mb, file_size_mb, max_procs, max_files, namespaces)
    program, cases = _parse_tests(code, tests)
    out = _sandboxed(program, cases, {**limits, "float_tol": float(float_tol)})
    iso = out["isolation"]
    return CodeResult(
        passed=out["verdict"] == "passed",
        reason=out["verdict"],
        num_tests=len(cases),
        num_passed=out["num_passed"],
        wall_s=out["wall_s"],
        stdout=out.get("stdout", ""),
        stderr=out.get("stderr", ""),
        network_isolated=iso["network_isolated"],
        fs_isolated=iso["fs_isolated"],
        pid_isolated=iso["pid_isolated"],
        notes=tuple(iso["notes"]),
    )


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """Outcome of :func:`execute`.

    Attributes:
      stdout: the program's stdout; when longer than the window, its head and tail joined by
        :data:`OUTPUT_CUT`. The sandbox's temp dir (the working directory, whose name is
        random) is written ``.``, so that the same code gives the same output.
      stderr: the same for stderr (a traceback ends up here).
      exit_code: the program's exit status; negative for a signal (``-9`` when killed at the
        deadline), ``None`` when the program never ran to an exit the sandbox could see.
      reason: ``"ok"`` (exit 0), ``"runtime_error"``, ``"syntax_error"``, ``"timeout"``,
        ``"memory_limit"``, ``"output_limit"``, ``"wrote_outside_sandbox"`` or
        ``"sandbox_error"``.
      wall_s: wall-clock seconds of the whole run, sandbox set-up included.
      network_isolated, fs_isolated, pid_isolated, notes: as in :class:`CodeResult`.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    reason: str
    wall_s: float = 0.0
    network_isolated: bool = False
    fs_isolated: bool = False
    pid_isolated: bool = False
    notes: tuple[str, ...] = ()


OUTPUT_CUT = "\n[... output truncated ...]\n"


def _join_window(parts: str | list[str], workdir: str | None) -> str:
    # The bootstrap gives [text], or [head, tail] when the output was longer than its window.
    text = parts if isinstance(parts, str) else OUTPUT_CUT.join(parts)
    if workdir is None:
        return text
    # The temp dir's name is random; relative to the program's working directory, the same
    # code gives the same output (a traceback's "File ./solution.py") on every run.
    for path in sorted({workdir, os.path.realpath(workdir)}, key=len, reverse=True):
        text = text.replace(path + "/", "./").replace(path, ".")
    return text


def execute(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    file_size_mb: int = 16,
    max_procs: int = 32,
    max_files: int = 64,
    output_window_bytes: int = 65536,
    namespaces: bool = True,
) -> ExecResult:
    """Runs `code` once in the sandbox of :func:`run_code`; its stdout, stderr and exit code.

    The same isolation as :func:`run_code` (temp dir, scrubbed environment, no network,
    read-only filesystem, resource limits, wall-clock deadline); what a tool call runs. Never
    raises for anything the program does. Safe to call from many threads at once.

    Args:
      code: Python source.
      stdin: text fed on the program's stdin.
      timeout_s: as in :func:`run_code`.
      memory_mb: as in :func:`run_code`.
      file_size_mb: as in :func:`run_code`.
      max_procs: as in :func:`run_code`.
      max_files: as in :func:`run_code`.
      output_window_bytes: at most this many bytes of each stream come back: the first and
        the last half, joined by :data:`OUTPUT_CUT`, when the output was longer.
      namespaces: as in :func:`run_code`.

    Returns:
      An :class:`ExecResult`.

    Examples:
      >>> execute("print(6 * 7)").stdout
      '42\\n'
    """
    if output_window_bytes < 2:
        raise ValueError(f"output_window_bytes must be >= 2, got {output_window_bytes}")
    limits = _limits(timeout_s, memory_mb, file_size_mb, max_procs, max_files, namespaces)
    head = output_window_bytes // 2
    window = [head, output_window_bytes - head]
    case = {"stdin": stdin, "expected": None}
    out = _sandboxed(code, [case], {**limits, "float_tol": 0.0, "output_window": window})
    iso = out["isolation"]
    verdict = out["verdict"]
    return ExecResult(
        stdout=_join_window(out.get("stdout", ""), out.get("workdir")),
        stderr=_join_window(out.get("stderr", ""), out.get("workdir")),
        exit_code=out.get("exit_code"),
        reason="ok" if verdict == "passed" else verdict,
        wall_s=out["wall_s"],
        network_isolated=iso["network_isolated"],
        fs_isolated=iso["fs_isolated"],
        pid_isolated=iso["pid_isolated"],
        notes=tuple(iso["notes"]),
    )


def _run_boot(job: str, workdir: str, deadline_s: float, uid: int | None) -> str | None:
    """Runs the bootstrap; its stdout (the result JSON), or None past the deadline."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    proc = subprocess.Popen(
        [_INTERPRETER, "-I", "-S", _BOOT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=workdir,
        env=env,
        start_new_session=True,
        close_fds=True,
    )
    try:
        out, err = proc.communicate(job.encode(), timeout=deadline_s)
    except subprocess.TimeoutExpired:
        # The bootstrap leads its session and is not reaped yet (its pid cannot be reused):
        # one killpg reaches it and the PID-namespace init, whose death takes the namespace down.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    finally:
        # Anything that detached from the group (setsid) still runs under the sandbox's uid.
        if uid is not None:
            _kill_uids(range(uid, uid + 1))
    if proc.returncode != 0 or not out:
        return json.dumps(
            {
                "verdict": "sandbox_error",
                "num_passed": 0,
                "stderr": err.decode("utf-8", "replace")[-2000:],
                "isolation": {
                    "network_isolated": False,
                    "fs_isolated": False,
                    "pid_isolated": False,
                    "notes": [f"bootstrap exited with {proc.returncode}"],
                },
            }
        )
    return out.decode("utf-8", "replace")
