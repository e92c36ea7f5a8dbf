"""The RL trainer: :class:`Trainer` (one step at a time, or :meth:`Trainer.train` to the end),
and :func:`train` (a whole run from a config), which the ``delta-jax train`` command calls.

Imported lazily, so that ``delta_jax.rl.packing`` and friends load without the trainer.
"""

from typing import Any

__all__ = ["TrainResult", "Trainer", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from delta_jax.rl import trainer  # lazy: the trainer imports the whole stack

        return getattr(trainer, name)
    raise AttributeError(f"module 'delta_jax.rl' has no attribute {name!r}")
