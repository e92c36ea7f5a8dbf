"""One release's grace for a call form that changed: the loose keywords of the earlier form
folded into the options object that replaced them, with a ``DeprecationWarning`` naming the new
form. (The loss library keeps its own, :func:`delta_jax.losses.options.apply_legacy_keywords`:
it imports nothing of the package.)"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def fold_keywords(func: str, options: T, legacy: Mapping[str, Any], new_form: str) -> T:
    """``options`` (a dataclass) with the fields named in ``legacy`` replaced; a warning, at
    the caller of ``func``, says to pass ``new_form`` instead. A keyword that is not a field of
    ``options`` raises ``TypeError``, as Python does for an unknown keyword."""
    if not legacy:
        return options
    unknown = sorted(set(legacy) - {f.name for f in dataclasses.fields(options)})
    if unknown:
        raise TypeError(f"{func}() got an unexpected keyword argument {unknown[0]!r}")
    warnings.warn(
        f"{func}({', '.join(f'{k}=...' for k in legacy)}) is deprecated and will be removed in "
        f"the next release: pass {new_form} instead",
        DeprecationWarning,
        stacklevel=3,
    )
    return dataclasses.replace(options, **legacy)
