"""Run one benchmark command at two commits in turn, so that both see the same machine load.

A before/after comparison made one commit after the other mixes the change with whatever else
the (shared, noisy) machine did in between; alternating the two commits over several rounds
does not. ::

    python benchmarks/interleave.py --base b05fc09 --rounds 3 \\
        --out benchmarks/results/cpu/recut/engines_interleaved.txt -- \\
        python benchmarks/sampler_throughput.py --engines --repeats 3

checks ``--base`` out into a temporary worktree and runs the command ``--rounds`` times in each
tree, base first, alternating (each run with its tree as working directory and on
``PYTHONPATH``), echoing the output. ``--out`` keeps every run's output under one provenance
line (see ``record.py``): the command with the base commit, and HEAD's commit. A failing run
stops the rounds and writes nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

ROOT = record.ROOT


def _run(command: list[str], tree: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    lines = (done.stdout + done.stderr).splitlines(keepends=True)
    output = "".join(line for line in lines if not record.is_noise(line))
    print(output, end="", flush=True)
    if done.returncode:
        raise SystemExit(f"error: {shlex.join(command)} failed at {tree} (exit {done.returncode})")
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare HEAD's tree with")
    parser.add_argument("--rounds", type=int, default=3, help="runs per commit (default 3)")
    parser.add_argument("--out", type=Path, help="where to keep the outputs (optional)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.rounds < 1:
        parser.error("give --rounds >= 1 and a command after --")
    base = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.base],
        capture_output=True,
        text=True,
    )
    if base.returncode:
        parser.error(f"--base {args.base!r} is not a commit of this repository")
    base_sha = base.stdout.strip()
    line = f"python benchmarks/interleave.py --base {base_sha} --rounds {args.rounds} -- "
    first = record.header(line + shlex.join(command))  # HEAD's commit; the base's is in it
    parts = [first]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", str(tree), base_sha], check=True)
        try:
            for i in range(args.rounds):
                for name, where in ((f"base {base_sha}", tree), (f"head {record.commit()}", ROOT)):
                    title = f"## round {i + 1}, {name}"
                    print(title, flush=True)
                    parts += [title, _run(command, where).rstrip("\n")]
        finally:
            subprocess.run([*git, "remove", "--force", str(tree)], check=False)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
