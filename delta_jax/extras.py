"""Optional dependencies: the package's extras, imported where a feature needs one.

Everything the commands import on every run is a dependency in ``pyproject.toml``; what only
some runs need is an extra (``gym``: reasoning-gym's tasks; ``tpu``: libtpu, the TPU runtime and
the planner's compiler; ``wandb``: Weights & Biases logging). A feature that needs a missing
extra raises :class:`MissingExtra`, whose message is one line naming the ``pip install`` that
fixes it; the command line prints it as its ``error:`` line, and :class:`~delta_jax.Trainer`
raises it before it loads anything.

Examples:
  >>> from delta_jax import extras
  >>> extras.install_command("gym").endswith('[gym]"')
  True
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib import metadata
from pathlib import Path
from types import ModuleType

# extra -> the module a feature imports from it
MODULES = {"gym": "reasoning_gym", "tpu": "libtpu", "wandb": "wandb"}
SOURCE = Path(__file__).resolve().parents[1]  # the checkout, for a source install


class MissingExtra(ImportError):
    """An optional dependency is not installed; ``str(e)`` says which install adds it."""


def install_command(extra: str, root: Path | None = SOURCE) -> str:
    """The ``pip install`` that adds ``extra`` to this installation: the checkout's extra for a
    source (editable) install (``.`` when it is the working directory), else the extra's own
    requirements (as the package's metadata lists them)."""
    if root is not None and (root / "pyproject.toml").is_file():
        where = "." if root == Path.cwd().resolve() else str(root)
        return f'pip install -e "{where}[{extra}]"'
    marker = f'extra == "{extra}"'
    needs = [r.split(";")[0].strip() for r in metadata.requires("delta_jax") or () if marker in r]
    return "pip install " + " ".join(f'"{r}"' for r in needs or [f"delta_jax[{extra}]"])


def installed(extra: str) -> bool:
    """Whether ``extra``'s module can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(MODULES[extra]) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken package
        return False


def require(extra: str, what: str) -> ModuleType:
    """``extra``'s module, imported; :class:`MissingExtra` naming ``what`` needs it if absent."""
    name = MODULES[extra]
    try:
        return importlib.import_module(name)
    except ImportError:
        raise MissingExtra(missing(extra, what)) from None


def missing(extra: str, what: str) -> str:
    """The one line that says ``what`` needs ``extra`` and how to install it."""
    return f"{what} needs {MODULES[extra]}, which is not installed: {install_command(extra)}"
