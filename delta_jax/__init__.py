"""delta_jax: JAX/TPU-native RLVR training built around DelTA.

This top-level module deliberately imports nothing heavy: ``import delta_jax.losses`` must load
only jax and numpy, so sub-packages are imported explicitly by the caller, and :class:`Trainer`
(the library's front door, :mod:`delta_jax.rl.trainer`) is loaded on first access.
"""

import logging
from typing import Any

__version__ = "0.1.0"
__all__ = ["TrainResult", "Trainer"]


class _NoTorchAdvice(logging.Filter):
    """Drops ``transformers``' start-up advice that PyTorch was not found: this package runs
    its models in JAX and uses ``transformers`` for tokenizers and configs only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("PyTorch was not found"))


# On the logger ``transformers/__init__.py`` warns with, before anything here imports it.
if not any(isinstance(f, _NoTorchAdvice) for f in logging.getLogger("transformers").filters):
    logging.getLogger("transformers").addFilter(_NoTorchAdvice())


def __getattr__(name: str) -> Any:
    if name in __all__:
        # Lazy: `from delta_jax import Trainer` loads the trainer (flax, transformers, ...) on
        # first use, and `import delta_jax.losses` nothing of it.
        from delta_jax.rl import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'delta_jax' has no attribute {name!r}")
