"""Argument checks for :mod:`delta_jax.losses.delta`.

Shapes and dtypes are static under ``jit``, so every check here runs before tracing and also
inside jitted code; errors name the argument and the offending shapes or values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array

from delta_jax.losses.options import DeltaOptions, TopkInputs

_TOPK_ARGS = ("lm_head", "token_ids", "topk_logits", "topk_ids")


class Chunk(NamedTuple):
    """The per-token inputs of one (micro-)batch; topk fields are None for ``lm_head_row``."""

    hidden: Array | None
    logprobs: Array
    advantages: Array
    mask: Array
    token_ids: Array | None
    topk_logits: Array | None
    topk_ids: Array | None


def check_call(options: DeltaOptions, mesh: Any, return_diagnostics: Any) -> None:
    """Checks the arguments of a call that its options alone do not decide."""
    if not isinstance(return_diagnostics, bool):
        raise ValueError(f"return_diagnostics must be a bool, got {return_diagnostics!r}")
    if mesh is None:
        return
    axis_name = options.axis_name
    if axis_name is None:
        raise ValueError("mesh needs axis_name (the mesh axis the batch is split over)")
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    missing = [n for n in names if n not in mesh.axis_names]
    if missing:
        raise ValueError(f"axis_name {missing} not in mesh axes {mesh.axis_names}")


def _kind(x: Array) -> str:
    if jnp.issubdtype(x.dtype, jnp.floating):
        return "float"
    if jnp.issubdtype(x.dtype, jnp.integer):
        return "int"
    return "bool" if x.dtype == jnp.bool_ else str(x.dtype)


def _array(name: str, x: Any, shape: tuple, kinds: tuple[str, ...], ref: str = "") -> Array:
    """``x`` as an array of ``shape`` (None entries free) whose dtype kind is in ``kinds``.

    ``ref`` names the arguments the expected shape comes from, for the error message.
    """
    x = jnp.asarray(x)
    ok = x.ndim == len(shape)
    ok = ok and all(s is None or s == d for s, d in zip(shape, x.shape, strict=True))
    if not ok:
        want = "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"
        ref = f" to match {ref}" if ref else ""
        raise ValueError(f"{name} must have shape {want}{ref}, got {tuple(x.shape)}")
    if _kind(x) not in kinds:
        raise ValueError(f"{name} must have a {' or '.join(kinds)} dtype, got {x.dtype}")
    return x


def _as_list(name: str, xs: Any, n: int | None) -> list:
    if not isinstance(xs, Sequence):
        raise ValueError(f"{name} must be a sequence of arrays (one per micro-batch)")
    if n is not None and len(xs) != n:
        raise ValueError(f"{name} has {len(xs)} micro-batches, logprobs has {n}")
    return list(xs)


def check_chunks(
    proxy: str,
    *,
    hiddens: Sequence[Any],
    logprobs: Sequence[Any],
    advantages: Sequence[Any],
    masks: Sequence[Any],
    topk: TopkInputs | None,
    indexed: bool,
) -> tuple[list[Chunk], Array | None]:
    """Checks every (micro-)batch; returns them as :class:`Chunk` s and the LM-head weight.

    ``topk`` holds one array per (micro-)batch in its per-token fields.
    """
    topk = (topk or TopkInputs())._asdict()
    lm_head = topk["lm_head"]
    if proxy == "lm_head_row":
        given = [n for n in _TOPK_ARGS if topk[n] is not None]
        if given:
            raise ValueError(f"{given} are only used by proxy='hidden_topk'")
    else:
        absent = [n for n in _TOPK_ARGS if topk[n] is None]
        if absent:
            raise ValueError(f"proxy='hidden_topk' needs {absent}")
        lm_head = _array("lm_head", lm_head, (None, None), ("float",))

    n = len(_as_list("logprobs", logprobs, None))
    if n == 0:
        raise ValueError("logprobs holds no micro-batch")
    named = [("hiddens", hiddens), ("advantages", advantages), ("masks", masks)]
    lists = {name: _as_list(name, xs, n) for name, xs in named}
    if proxy == "hidden_topk":
        lists.update({name: _as_list(name, topk[name], n) for name in _TOPK_ARGS[1:]})

    width = None if lm_head is None else lm_head.shape[0]
    src = f"lm_head {None if lm_head is None else tuple(lm_head.shape)}"
    chunks = []
    for i in range(n):
        tag = f"[{i}]" if indexed else ""
        lp = _array(f"logprobs{tag}", logprobs[i], (None, None), ("float",))
        b, t = lp.shape
        h = lists["hiddens"][i]
        if h is None and proxy == "lm_head_row":
            raise ValueError(f"hidden{tag} is required by proxy='lm_head_row'")
        if h is not None:
            ref = f"logprobs{tag} {(b, t)}" + ("" if width is None else f" and H={width} of {src}")
            h = _array(f"hidden{tag}", h, (b, t, width), ("float",), ref)
            width, src = h.shape[2], f"hidden{tag}"
        ref = f"logprobs{tag} {(b, t)}"
        # Per response [b], or per token [b, t] (packed rows hold several responses).
        adv_shape = (b, t) if jnp.ndim(advantages[i]) == 2 else (b,)
        adv = _array(f"advantages{tag}", advantages[i], adv_shape, ("float", "int"), ref)
        m = _array(f"mask{tag}", masks[i], (b, t), ("float", "int", "bool"), ref)
        ids = logits = top = None
        if proxy == "hidden_topk":
            ids = _array(f"token_ids{tag}", lists["token_ids"][i], (b, t), ("int",), ref)
            logits = lists["topk_logits"][i]
            logits = _array(f"topk_logits{tag}", logits, (b, t, None), ("float",), ref)
            ref = f"topk_logits{tag} {tuple(logits.shape)}"
            top = _array(f"topk_ids{tag}", lists["topk_ids"][i], logits.shape, ("int",), ref)
        chunks.append(Chunk(h, lp, adv, m, ids, logits, top))
    return chunks, lm_head
