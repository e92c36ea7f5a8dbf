"""Sandbox bootstrap: isolates itself, then runs an untrusted program against test cases.

Run by :func:`delta_jax.rewards.code.run_code` as ``python -I -S _sandbox_boot.py`` in a new
session, with a scrubbed environment and the sandbox's temporary directory as its working
directory. It imports nothing from the package (it must start fast and trust nothing on
``sys.path``). Protocol: one JSON job on stdin, one JSON result on stdout.

Steps, each degrading to a reported flag where the kernel or container refuses it:

1. ``unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)`` (plus ``CLONE_NEWUSER`` when not
   root). The new network namespace holds only a loopback device that is down, so every
   connection fails, 127.0.0.1 included.
2. In the new mount namespace every mount is remounted read-only; the working directory is then
   bind-mounted onto itself read-write. The program can write its working directory and nothing
   else: ``/tmp`` and ``/dev/shm`` are world-writable in the host, read-only here.
3. A fork: the child is PID 1 of the new PID namespace and mounts a fresh ``/proc`` (host
   processes, and their environments, are invisible). When it exits the kernel kills every
   process left in the namespace, so a fork bomb cannot outlive the run.
4. PID 1 runs the program once per test case, as an unprivileged uid with resource limits
   (``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC``, ``RLIMIT_NOFILE``,
   ``RLIMIT_CORE``), stdout and stderr going to files (so ``RLIMIT_FSIZE`` caps them), and
   compares the output with the expected one here, where the program cannot reach it.
"""

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
# A remount must restate these: in a user namespace they are locked and dropping one fails.
_KEPT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}

PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)
_OUTPUT_CAP = 1 << 20


def _mount(source, target, fstype, flags):
    rc = _libc.mount(
        None if source is None else source.encode(),
        target.encode(),
        None if fstype is None else fstype.encode(),
        ctypes.c_ulong(flags),
        None,
    )
    if rc != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), target)


def _unshare(flags):
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _mount_points():
    """(mount point, its per-mount flags) of every mount, from /proc/self/mountinfo."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            # Octal escapes (\040 for a space) appear in mountinfo for unusual paths.
            point = fields[4].encode().decode("unicode_escape")
            options = fields[5].split(",")
            points.append((point, sum(v for k, v in _KEPT_FLAGS.items() if k in options)))
    return points


def _expose_python(prefix, workdir, flags):
    """Makes the interpreter under `prefix` reachable by the sandbox's uid.

    A Python installed under a directory others cannot traverse (``/root/.pyenv``) cannot be
    executed after dropping privileges. In our mount namespace, a tmpfs goes over the first
    such ancestor (hiding the rest of it) and the install is moved into it at the same path.
    """
    blocked = None
    path = "/"
    for part in prefix.strip("/").split("/"):
        path = os.path.join(path, part)
        if path != prefix and not os.stat(path).st_mode & 0o001:
            blocked = path
            break
    if blocked is None:
        return
    stash = os.path.join(workdir, ".python")
    os.mkdir(stash)
    _mount(prefix, stash, None, MS_BIND | MS_REC)
    _mount("tmpfs", blocked, "tmpfs", MS_NOSUID | MS_NODEV)
    os.chmod(blocked, 0o755)
    os.makedirs(prefix, mode=0o755)
    _mount(stash, prefix, None, MS_MOVE)
    os.rmdir(stash)
    flags["notes"].append(f"{blocked} replaced by an empty tmpfs holding only {prefix}")


def _isolate(workdir, prefix, dropping_uid, flags):
    """Enters new namespaces and makes the filesystem read-only outside `workdir`."""
    wanted = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    if os.geteuid() != 0:
        # Without root, a user namespace is the only way to get the other namespaces.
        uid, gid = os.geteuid(), os.getegid()
        try:
            _unshare(wanted | CLONE_NEWUSER)
        except OSError as e:
            flags["notes"].append(f"unshare(user+ns): {e.strerror}")
            return
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
    else:
        try:
            _unshare(wanted)
        except OSError as e:
            flags["notes"].append(f"unshare: {e.strerror}")
            return
    flags["network_isolated"] = True
    flags["pid_isolated"] = True
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        if dropping_uid:
            _expose_python(prefix, workdir, flags)
        _mount(workdir, workdir, None, MS_BIND)
        failed = []
        for point, kept in _mount_points():
            if point == workdir:
                continue
            try:
                _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
            except OSError:
                failed.append(point)
        if failed:
            flags["notes"].append("could not make read-only: " + ",".join(failed))
        flags["fs_isolated"] = not failed
    except OSError as e:
        flags["notes"].append(f"mount: {e.strerror}")


def _limits(job):
    cpu = int(job["timeout_s"]) + 1
    mem = int(job["memory_mb"]) << 20
    fsize = int(job["file_size_mb"]) << 20
    nproc = int(job["max_procs"])
    nofile = int(job["max_files"])
    uid = job["uid"]

    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if uid is not None:
            # Counted per uid: the sandbox's own uid makes this a per-sandbox limit.
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return apply


def _kill_leftovers(proc, pid_isolated):
    if pid_isolated:
        # PID 1 of the namespace: -1 reaches every other process in it, however it detached.
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _reap():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _new_file(path):
    """A fresh file we hold open; never one the program planted (a symlink, say) at `path`."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)


def _read_back(fd, cap):
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, cap).decode("utf-8", "replace")


def _read_window(fd, head, tail):
    """[whole text], or [its first `head` bytes, its last `tail` bytes] when longer.

    The tail is read from the end of the file, however long the program's output was.
    """
    size = os.fstat(fd).st_size
    if size <= head + tail:
        return [_read_back(fd, size)]
    first = os.pread(fd, head, 0).decode("utf-8", "ignore")
    last = os.pread(fd, tail, size - tail).decode("utf-8", "ignore")
    return [first, last]


def _same_token(a, b, tol):
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return abs(x - y) <= tol * max(1.0, abs(y))


def _output_matches(got, expected, tol):
    """Token-wise comparison: whitespace and line breaks are not significant."""
    got_tokens, exp_tokens = got.split(), expected.split()
    if len(got_tokens) != len(exp_tokens):
        return False
    return all(_same_token(g, e, tol) for g, e in zip(got_tokens, exp_tokens, strict=True))


def _classify(rc, timed_out, stderr):
    if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if rc == -signal.SIGXFSZ:
        return "output_limit"
    if "File too large" in stderr:
        return "output_limit"  # Python ignores SIGXFSZ: the write fails with EFBIG instead.
    if "MemoryError" in stderr:
        return "memory_limit"
    if "SyntaxError" in stderr or "IndentationError" in stderr:
        return "syntax_error"
    return "runtime_error"


def _run_cases(job, flags):
    workdir = os.getcwd()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    deadline = time.monotonic() + job["timeout_s"]
    preexec = _limits(job)
    result = {"verdict": "passed", "num_passed": 0, "stderr": "", "stdout": ""}
    for i, case in enumerate(job["cases"]):
        # Held open and read back by descriptor: the program owns the directory and may swap
        # the paths, but not these files.
        fds = [_new_file(os.path.join(workdir, f".{name}{i}")) for name in ("in", "out", "err")]
        os.write(fds[0], case["stdin"].encode())
        os.lseek(fds[0], 0, os.SEEK_SET)
        proc = subprocess.Popen(
            [job["interpreter"], "-I", job["program"]],
            stdin=fds[0],
            stdout=fds[1],
            stderr=fds[2],
            env=env,
            cwd=workdir,
            preexec_fn=preexec,
            start_new_session=True,
        )
        timed_out = False
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = None
        _kill_leftovers(proc, flags["pid_isolated"])
        if rc is None:
            rc = proc.wait()
        _reap()
        stdout, stderr = _read_back(fds[1], _OUTPUT_CAP), _read_back(fds[2], _OUTPUT_CAP)
        window = job.get("output_window")  # [head, tail] bytes: execute() reports both ends.
        if window is not None:
            result["stdout"] = _read_window(fds[1], *window)
            result["stderr"] = _read_window(fds[2], *window)
        else:
            result["stdout"], result["stderr"] = stdout[-2000:], stderr[-2000:]
        for fd in fds:
            os.close(fd)
        result["exit_code"] = rc
        if timed_out or rc != 0:
            result["verdict"] = _classify(rc, timed_out, stderr)
            return result
        expected = case.get("expected")
        if expected is not None and not _output_matches(stdout, expected, job["float_tol"]):
            result["verdict"] = "wrong_answer"
            return result
        if case.get("sentinel") is not None and stdout.rstrip().splitlines()[-1:] != [
            case["sentinel"]
        ]:
            # The program exited 0 without running the tests to the end (e.g. sys.exit(0)).
            result["verdict"] = "tests_not_run"
            return result
        result["num_passed"] += 1
    return result


def _reachable_by_others(path):
    parts = os.path.realpath(path).strip("/").split("/")
    dirs = ["/" + "/".join(parts[:i]) for i in range(len(parts))]
    return all(os.stat(d).st_mode & 0o001 for d in dirs + [os.path.realpath(path)])


def _choose_interpreter(job, flags):
    """Our interpreter, or a system one when ours is out of the dropped uid's reach."""
    if job["uid"] is None or flags["fs_isolated"] or _reachable_by_others(sys.executable):
        return sys.executable
    for candidate in ("/usr/local/bin/python3", "/usr/bin/python3"):
        if os.path.exists(candidate) and _reachable_by_others(candidate):
            flags["notes"].append(f"{sys.executable} not reachable by the sandbox uid: {candidate}")
            return candidate
    return sys.executable


def _run_reported(job, flags):
    try:
        result = _run_cases(job, flags)
    except Exception as e:  # noqa: BLE001 - anything here is a sandbox failure, reported
        result = {"verdict": "sandbox_error", "num_passed": 0, "stderr": repr(e)}
    result["isolation"] = flags
    return json.dumps(result)


def _die_with_parent(parent_pid):
    # A reward worker killed at its deadline must not leave its sandbox running.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # The parent died before prctl took effect.
        os._exit(1)


def main():
    _die_with_parent(os.getppid())
    job = json.loads(sys.stdin.read())
    flags = {"network_isolated": False, "fs_isolated": False, "pid_isolated": False, "notes": []}
    workdir = os.path.realpath(os.getcwd())
    if job["namespaces"]:
        prefix = os.path.realpath(job["python_prefix"])
        _isolate(workdir, prefix, job["uid"] is not None, flags)
    else:
        flags["notes"].append("namespaces disabled by the caller")
    if job["uid"] is None:
        # RLIMIT_NPROC would count all of our user's processes; the PID namespace (when we have
        # one) and the timeout bound a fork bomb instead.
        flags["notes"].append("no uid of its own: RLIMIT_NPROC not set")
    job["interpreter"] = _choose_interpreter(job, flags)
    if not flags["pid_isolated"]:
        sys.stdout.write(_run_reported(job, flags))
        return 0
    # The child is PID 1 of the new namespace; the pipe carries its result back to us.
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        # getppid() is 0 here (our parent is outside the namespace); prctl still binds us to it.
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.close(read_fd)
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError as e:
            flags["notes"].append(f"mount /proc: {e.strerror}")
        with os.fdopen(write_fd, "w") as f:
            f.write(_run_reported(job, flags))
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        data = f.read()
    os.waitpid(pid, 0)
    sys.stdout.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
