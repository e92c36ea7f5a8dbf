"""On a machine without PyTorch, ``transformers`` advises at import that models won't be
available; this package runs its models in JAX, and its commands start without that line."""

import os
import subprocess
import sys

ADVICE = "PyTorch was not found"
HIDE_TORCH = 'import sys; sys.modules["torch"] = None\n'  # what `import torch` finds without it


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    done = subprocess.run(
        [sys.executable, "-c", HIDE_TORCH + code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return done.stdout + done.stderr


def test_commands_start_without_the_pytorch_advice():
    out = _run(
        "from delta_jax import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        # What a command loads next: the tokenizer, through transformers.
        "import transformers\n"
        "import delta_jax.models.tokenizer\n"
        "assert not transformers.utils.is_torch_available()\n"
        "transformers.logging.get_logger('transformers').warning('other advice')\n"
    )
    assert "usage: delta-jax" in out
    assert ADVICE not in out
    assert "other advice" in out  # only that one line is dropped


def test_without_the_package_transformers_still_advises():
    """The check above is not vacuous: torch is hidden, and transformers does print it."""
    assert ADVICE in _run("import transformers\n")
