"""Host state of a run as one JSON value (the checkpoint's ``host`` document), exactly.

:func:`pack` turns NumPy arrays (their bytes in base64), NumPy scalars, tuples and dicts (any
keys) into JSON values that :func:`unpack` turns back into equal objects of the same types:
every JSON object in a packed value is a tag (``tuple``, ``dict``, ``array``, ``numpy``), so
nothing is mistaken for one. What the partial-rollout buffer and an asynchronous run's rollout
in flight keep between steps goes through it.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

__all__ = ["pack", "unpack"]


def pack(x: Any) -> Any:
    """``x`` as a JSON value that :func:`unpack` turns back into ``x`` exactly.

    Raises:
      TypeError: ``x`` holds something else than JSON values, tuples, dicts and NumPy arrays
        (of a NumPy dtype) and scalars.
    """
    if x is None or isinstance(x, bool | int | float | str):
        return x
    if isinstance(x, list):
        return [pack(v) for v in x]
    if isinstance(x, tuple):
        return {"tuple": [pack(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[pack(k), pack(v)] for k, v in x.items()]}
    if isinstance(x, np.ndarray) and x.dtype.kind not in "OV":
        data = base64.b64encode(np.ascontiguousarray(x).tobytes()).decode("ascii")
        return {"array": [x.dtype.str, list(x.shape), data]}
    if isinstance(x, np.generic):
        return {"numpy": [x.dtype.str, pack(x.item())]}
    raise TypeError(
        f"host state holds a {type(x).__name__}, which a checkpoint's JSON document cannot "
        "keep (JSON values, tuples, dicts and NumPy values can be kept)"
    )


def unpack(x: Any) -> Any:
    """The value :func:`pack` packed.

    Raises:
      ValueError: a JSON object that is not one of the tags.
    """
    if isinstance(x, list):
        return [unpack(v) for v in x]
    if not isinstance(x, dict):
        return x
    if len(x) != 1:
        raise ValueError(f"not a packed value: an object with keys {sorted(x)}")
    ((tag, value),) = x.items()
    if tag == "tuple":
        return tuple(unpack(v) for v in value)
    if tag == "dict":
        return {unpack(k): unpack(v) for k, v in value}
    if tag == "array":
        dtype, shape, data = value
        return np.frombuffer(base64.b64decode(data), np.dtype(dtype)).reshape(shape).copy()
    if tag == "numpy":
        return np.dtype(value[0]).type(unpack(value[1]))
    raise ValueError(f"not a packed value: tag {tag!r}")
