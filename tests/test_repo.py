"""Repository invariants: the CI script runs exactly the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    test_cmd = next(c for c in commands if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd.strip() in ci.splitlines()
    assert "set -euo pipefail" in ci  # a failing or empty pytest run fails CI (exit 1 / 5)
