"""The README and the docs pages: their code runs as written, their commands parse and name
configs that load, the README stays short, and the loss package stays dependency-light."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compile_flags import as_a_user

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _section_code(title: str, page: str = "README.md") -> str:
    """The first Python block of the section headed ``title`` (``## `` in the README, the
    page's ``# `` title in a docs page)."""
    text = (ROOT / page).read_text()
    section = re.split(rf"^#{{1,2}} {re.escape(title)}\n", text, maxsplit=1, flags=re.M)[1]
    section = section.split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)\n```", section, flags=re.S).group(1)


_HEAVY = ("flax", "transformers", "torch", "grain", "orbax", "datasets", "optax")
_CHECK = f"""
import sys
heavy = [m for m in {_HEAVY!r} if m in sys.modules]
assert not heavy, heavy
print("ok")
"""


def test_readme_loss_snippet_runs_with_only_jax_and_numpy():
    code = _section_code("Use the loss in your own JAX project")
    proc = subprocess.run(
        [sys.executable, "-c", code + _CHECK], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_import_losses_loads_no_heavy_dependency():
    code = "import delta_jax.losses" + _CHECK
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_readme_starts_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    assert "delta-jax train --config configs/demo.yaml" in blocks[0]
    assert "pytest" in blocks[1]


@pytest.mark.slow  # a short demo warm-up and two RL steps
def test_readme_trainer_snippet_runs(tmp_path):
    code = _section_code("Use the trainer from Python")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
        timeout=900, env=as_a_user(),  # a 100-step warm-up: as a user's shell runs it
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line[:2] in ("1 ", "2 ")]
    assert [line[0] for line in lines] == ["1", "2"]
    for _, math, boxed, loss in lines:
        assert 0 <= float(math) <= 1 and 0 <= float(boxed) <= 1 and loss != "nan"
    assert (tmp_path / "runs" / "api_demo" / "checkpoints" / "2").exists()


@pytest.mark.slow  # a short demo warm-up and two multi-turn RL steps
def test_readme_environment_snippet_runs(tmp_path):
    code = _section_code("Multi-turn episodes and tools", "docs/multiturn.md")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
        timeout=900, env=as_a_user(),  # a 100-step warm-up: as a user's shell runs it
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line[:2] in ("1 ", "2 ")]
    assert [line[0] for line in lines] == ["1", "2"]
    for _, turns, share, loss in lines:
        # Most responses start with "Answer:": their episodes got the hint, in context.
        assert 1.5 <= float(turns) <= 2 and 0 < float(share) < 1 and loss != "nan"


@pytest.mark.parametrize(
    ("readme_title", "page"),
    [
        ("Use the trainer from Python", "docs/trainer.md"),
        ("Use the loss in your own JAX project", "docs/losses.md"),
    ],
)
def test_docs_pages_show_the_readme_snippets_unchanged(readme_title, page):
    # The README's copy is the one the tests above run; the docs page must not drift from it.
    page_title = (ROOT / page).read_text().split("\n", 1)[0].removeprefix("# ")
    assert _section_code(page_title, page) == _section_code(readme_title)


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: move detail into docs/"


def _documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every ``delta-jax`` command in a fenced block of the README or a docs
    page, continuation lines joined and trailing comments dropped."""
    found = []
    for page in PAGES:
        text = page.read_text()
        fences = re.findall(r"^( *)```(?:bash|text)\n(.*?)\n\1```", text, flags=re.S | re.M)
        for _, block in fences:
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line)
                if "delta-jax " in line and not line.lstrip().startswith("#"):
                    command = line[line.index("delta-jax ") :]
                    found.append((str(page.relative_to(ROOT)), command.split(" && ")[0]))
    return found


def test_documented_commands_parse_and_their_configs_load():
    """Every documented ``delta-jax`` command parses with the CLI's own parser, and its config
    with its ``key=value`` overrides loads (keys and values type-checked) without running it."""
    from delta_jax.cli import build_parser
    from delta_jax.config import load_config

    commands = _documented_commands()
    assert any(c.startswith("delta-jax train --config configs/demo.yaml") for _, c in commands)
    parser = build_parser()
    for page, command in commands:
        args = parser.parse_args(shlex.split(command)[1:])
        if getattr(args, "config", None) is not None:
            assert (ROOT / args.config).exists(), f"{page}: {command}: no {args.config}"
            load_config(ROOT / args.config, getattr(args, "overrides", []))


def test_readme_layout_names_every_top_level_module():
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    package = ROOT / "delta_jax"
    entries = [f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()]
    entries += [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    missing = sorted(e for e in entries if f"delta_jax/{e}" not in layout)
    assert not missing, f"README's Layout misses {missing}"
