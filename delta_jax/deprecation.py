"""One release's grace for a call form that changed: a ``DeprecationWarning`` naming the new
form (:func:`warn`), and the loose keywords of an earlier form folded into the options object
that replaced them (:func:`fold_keywords`). (The loss library keeps its own,
:func:`delta_jax.losses.options.apply_legacy_keywords`: it imports nothing of the package.)"""

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
    warn(f"{func}({', '.join(f'{k}=...' for k in legacy)})", new_form, stacklevel=4)
    return dataclasses.replace(options, **legacy)


def warn(old_form: str, new_form: str, stacklevel: int = 3) -> None:
    """A ``DeprecationWarning``: ``old_form`` goes in the next release, ``new_form`` replaces it
    (``stacklevel``: as :func:`warnings.warn`'s, counted from here: 2 is this call's line,
    3 its caller's)."""
    warnings.warn(
        f"{old_form} is deprecated and will be removed in the next release: pass {new_form} "
        "instead",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
