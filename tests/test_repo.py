"""Repository invariants: the CI script runs exactly the README's test command; the package
declares what it imports."""

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import tomllib

from delta_jax import extras

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


def _imported_top_level_modules() -> set[str]:
    """Top-level names of every module the package imports, at module level or in functions."""
    found = set()
    for path in (ROOT / "delta_jax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"delta_jax", "__future__"}


def _declared(requirements: list[str]) -> set[str]:
    return {_normalise(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in requirements}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_module_the_package_imports_is_declared():
    """What the package imports comes from its dependencies or from the extra that guards it
    (delta_jax.extras), never only from the test extras (PyTorch brings jinja2, scipy, ...)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = _declared(project["dependencies"])
    guarded = _declared([r for e in extras.MODULES for r in project["optional-dependencies"][e]])
    # jax_plugins is the namespace accelerator plugins install into (delta_jax.distributed).
    undeclared = []
    for module in sorted(_imported_top_level_modules() - {"jax_plugins"}):
        dists = {_normalise(d) for d in metadata.packages_distributions().get(module, [module])}
        if not dists & (runtime | guarded):
            undeclared.append(f"{module} (from {sorted(dists)})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
