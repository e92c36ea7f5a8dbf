"""Run a benchmark command and keep its output under ``benchmarks/results/`` with its provenance.

Every figure the README and the docs state comes from a file written this way: its first line
is the command and the commit (and date, machine, load) that produced it, then the command's
output as it printed it (stdout and stderr, also echoed to the terminal)::

    python benchmarks/record.py benchmarks/results/cpu/rollout_ragged.txt -- \\
        python benchmarks/rollout_ragged.py --prompts 16

writes ``benchmarks/results/cpu/rollout_ragged.txt`` starting with the line
``# <command>  (commit <hash>, <date> UTC, <n> CPUs, load <1-minute load average>)``,
and ``python benchmarks/record.py --again FILE...`` runs each file's recorded command again (from
the repository root, through ``bash``, so ``VAR=value`` prefixes work) and rewrites the file.
A working tree with uncommitted changes is marked ``commit 941cc40+dirty``. A file is written
only when its command succeeds (a failed run leaves the previous result in place); the exit
status is the last failing command's, else 0.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# libtpu's start-up complaints on a machine without TPUs
LIBTPU_NOISE = (
    "TPU_WORKER_HOSTNAMES",
    "=== Source Location Trace: ===",
    "libtpu_init_utils",
    "Failed to find host bounds for accelerator type",
    "WARNING: Logging before InitGoogle() is written to STDERR",
)
# "# CMD  (commit ...)", and the older "# command: CMD" / "$ CMD   (...)" first lines
FIRST_LINE = re.compile(r"^(?:# command: |# |\$ )(?P<command>.*?)(?:\s{2,}\(.*\))?\s*$")


def is_noise(line: str) -> bool:
    """Whether an output line is libtpu's start-up complaint (left out of result files)."""
    return any(noise in line for noise in LIBTPU_NOISE)


def commit() -> str:
    """Short hash of HEAD, ``+dirty`` when tracked files differ from it, result files under
    ``benchmarks/results/`` aside (what a command writes, never what it runs: a batch of reruns
    rewrites them one after the other)."""
    git = ["git", "-C", str(ROOT)]
    sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if sha.returncode:
        return "unknown"
    paths = ["--", ".", ":(exclude)benchmarks/results"]
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", *paths], capture_output=True)
    return sha.stdout.strip() + ("+dirty" if dirty.returncode else "")


def header(command: str) -> str:
    """The first line of a result file: command, commit, date, machine."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    return f"# {command}  (commit {commit()}, {when}, {os.cpu_count()} CPUs, load {load:.2f})"


def recorded_command(path: Path) -> str:
    """The command on the first line of a result file."""
    first = path.read_text().split("\n", 1)[0]
    match = FIRST_LINE.match(first)
    if not match or not match.group("command"):
        raise SystemExit(f"error: {path}: first line names no command: {first[:120]!r}")
    return match.group("command")


def record(out: Path, command: str) -> int:
    """Run ``command`` (a shell line) from the repository root; on success write ``out``."""
    first = header(command)
    print(first, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", delete=False, dir=out.parent, suffix=".tmp") as tmp:
        tmp.write(first + "\n")
        proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            if is_noise(line):
                continue
            sys.stdout.write(line)
            tmp.write(line)
        rc = proc.wait()
    if rc == 0:
        Path(tmp.name).replace(out)
    else:
        Path(tmp.name).unlink()
        print(f"record: `{command}` exited with {rc}; {out} left as it was", file=sys.stderr)
    return rc


def main(argv: list[str]) -> int:
    if argv[:1] == ["--again"] and len(argv) > 1:
        jobs = [(Path(f), recorded_command(Path(f))) for f in argv[1:]]
    elif len(argv) >= 3 and argv[1] == "--":
        jobs = [(Path(argv[0]), shlex.join(argv[2:]))]
    else:
        print("usage: python benchmarks/record.py OUT -- COMMAND...\n"
              "       python benchmarks/record.py --again FILE...", file=sys.stderr)  # fmt: skip
        return 2
    rcs = [record(out, command) for out, command in jobs]
    return next((rc for rc in reversed(rcs) if rc), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
