"""The README's loss snippet runs as written, and the loss package stays dependency-light."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _section_code(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
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
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line[:2] in ("1 ", "2 ")]
    assert [line[0] for line in lines] == ["1", "2"]
    for _, math, boxed, loss in lines:
        assert 0 <= float(math) <= 1 and 0 <= float(boxed) <= 1 and loss != "nan"
    assert (tmp_path / "runs" / "api_demo" / "checkpoints" / "2").exists()


@pytest.mark.slow  # a short demo warm-up and two multi-turn RL steps
def test_readme_environment_snippet_runs(tmp_path):
    code = _section_code("Multi-turn episodes and tools")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line[:2] in ("1 ", "2 ")]
    assert [line[0] for line in lines] == ["1", "2"]
    for _, turns, share, loss in lines:
        # Most responses start with "Answer:": their episodes got the hint, in context.
        assert 1.5 <= float(turns) <= 2 and 0 < float(share) < 1 and loss != "nan"
