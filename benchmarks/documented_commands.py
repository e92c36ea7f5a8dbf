"""Run every shell command the README and the docs pages show, as written, and tabulate how each
ended: ``ok`` (exit 0), ``error`` (its last line), ``stopped`` (still running at the time limit:
a training run or a sweep is stopped once it is past its start), ``template`` (a command with
placeholders such as ``C.yaml`` or ``RUN_DIR``: not run, list concrete instances with --also).

    python benchmarks/documented_commands.py --list
    python benchmarks/documented_commands.py --timeout 300 --skip pytest --out results.md

Commands come from the fenced ``bash``/``text`` blocks (each line a command, after the block's
``cd`` / ``export`` lines) and from inline code spans that start a command (``python ...``,
``mkdocs ...``, ``pip install ...``, ``delta-jax`` with a config, a run or a model; a span that
names a command in passing, ``delta-jax train``, is not run). Each runs from the repository
root through ``bash`` in the environment this script runs in (its ``bin`` first on ``PATH``),
one at a time, in page order.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STARTS = (
    "delta-jax ",
    "python ",
    "python3 ",
    "mkdocs ",
    "pip install",
    "launch/",
    "cd ",
    "export ",
)
PLACEHOLDER = re.compile(r"\b(C\.yaml|RUN_DIR|DIR|FILE|PNG|OUT|S)\b|\.\.\.|\[section")


def documented() -> list[tuple[str, str]]:
    """``(page, command)`` in page order; a fenced block is one command (its lines joined)."""
    found = []
    for page in PAGES:
        text, name = page.read_text(), str(page.relative_to(ROOT))
        for lang, block in re.findall(r"^ *```(bash|text|sh)?\n(.*?)\n *```", text, re.S | re.M):
            lines = [ln for ln in block.replace("\\\n", " ").splitlines() if ln.startswith(STARTS)]
            if lang == "text" and not any(ln.startswith(STARTS[:3]) for ln in lines):
                continue  # a text block that shows output, not commands
            setup = [ln for ln in lines if ln.startswith(("cd ", "export "))]
            found += [(name, "\n".join([*setup, ln])) for ln in lines if ln not in setup]
        prose = re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]+)`", prose):
            # A span that names a command in passing (`delta-jax train`) is not one to run.
            named = span.startswith("delta-jax ") and not re.search(r"--(config|run|model)\b", span)
            if span.startswith(STARTS[:5]) and " " in span.strip() and not named:
                found.append((name, span))
    unique, seen = [], set()
    for page, command in found:
        if command not in seen:
            seen.add(command)
            unique.append((page, command))
    return unique


def run(command: str, timeout: float, env: dict[str, str]) -> tuple[str, float, str]:
    """``(outcome, seconds, last line)`` of one command in its own process group."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        ["bash", "-e", "-c", command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        outcome = "ok" if proc.returncode == 0 else f"error (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        outcome = "stopped"
    lines = [ln.strip() for ln in re.split(r"[\r\n]", out or "") if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("WARNING: Location")]  # pip's index notes
    return outcome, time.perf_counter() - t0, (lines[-1] if lines else "")[:160]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print the commands, run nothing")
    p.add_argument("--timeout", type=float, default=300, help="seconds per command")
    p.add_argument("--skip", nargs="*", default=[], help="skip commands containing these")
    p.add_argument("--only", nargs="*", default=[], help="run only commands containing these")
    p.add_argument("--also", nargs="*", default=[], help="more commands (concrete templates)")
    p.add_argument("--only-also", action="store_true", help="run the --also commands alone")
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    commands = [] if args.only_also else documented()
    commands += [("--also", c) for c in args.also]
    if args.list:
        for page, command in commands:
            kind = "template" if PLACEHOLDER.search(command) else "command"
            print(f"{page:28s} {kind:8s} {command!r}")
        return 0
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    rows = ["| page | command | outcome | seconds | last line |", "|---|---|---|---|---|"]
    for page, command in commands:
        if args.only and not any(s in command for s in args.only):
            continue
        if any(s in command for s in args.skip):
            outcome, seconds, last = "skipped (--skip)", 0.0, ""
        elif PLACEHOLDER.search(command) and page != "--also":
            outcome, seconds, last = "template", 0.0, ""
        else:
            outcome, seconds, last = run(command, args.timeout, env)
        flat = command.replace("\n", "; ")
        rows.append(f"| {page} | `{flat}` | {outcome} | {seconds:.0f} | {last.replace('|', '/')} |")
        print(rows[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
