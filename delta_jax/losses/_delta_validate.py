"""Argument checks for :mod:`delta_jax.losses.delta`.

Shapes and dtypes are static under ``jit``, so every check here runs before tracing and also
inside jitted code; errors name the argument and the offending shapes or values.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array

_CHOICES = {
    "assignment": ("soft", "hard"),
    "normalize": ("sum", "count"),
    "scope": ("global", "per_shard"),
    "proxy": ("lm_head_row", "hidden_topk"),
}
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


def check_options(args: Mapping[str, Any]) -> dict[str, Any]:
    """Validates the keyword options; returns those the computation needs."""
    for name, choices in _CHOICES.items():
        if args[name] not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {args[name]!r}")
    for name in ("adaptive_gamma", "range_map", "return_diagnostics"):
        if not isinstance(args[name], bool):
            raise ValueError(f"{name} must be a bool, got {args[name]!r}")
    k = args["refine_steps"]
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"refine_steps must be a non-negative int, got {k!r}")
    for name in ("lam_min", "lam_max", "eps"):
        value = args[name]
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite Python number, got {value!r}")
    if args["lam_min"] > args["lam_max"]:
        raise ValueError(f"lam_min={args['lam_min']} must be <= lam_max={args['lam_max']}")
    if args["eps"] <= 0:
        raise ValueError(f"eps must be > 0, got {args['eps']!r}")
    axis_name, mesh = args["axis_name"], args["mesh"]
    if args["scope"] == "per_shard" and axis_name is None:
        raise ValueError("scope='per_shard' needs axis_name, the mesh axis the batch is split over")
    if mesh is not None:
        if axis_name is None:
            raise ValueError("mesh needs axis_name (the mesh axis the batch is split over)")
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        missing = [n for n in names if n not in mesh.axis_names]
        if missing:
            raise ValueError(f"axis_name {missing} not in mesh axes {mesh.axis_names}")
    return {
        "refine_steps": int(k),
        "lam_min": float(args["lam_min"]),
        "lam_max": float(args["lam_max"]),
        "assignment": args["assignment"],
        "adaptive_gamma": args["adaptive_gamma"],
        "range_map": args["range_map"],
        "normalize": args["normalize"],
        "scope": args["scope"],
        "axis_name": axis_name,
        "proxy": args["proxy"],
        "eps": float(args["eps"]),
    }


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
    lm_head: Any,
    token_ids: Sequence[Any] | None,
    topk_logits: Sequence[Any] | None,
    topk_ids: Sequence[Any] | None,
    indexed: bool,
) -> tuple[list[Chunk], Array | None]:
    """Checks every (micro-)batch; returns them as :class:`Chunk` s and the LM-head weight."""
    topk = {"lm_head": lm_head, "token_ids": token_ids, "topk_logits": topk_logits,
            "topk_ids": topk_ids}  # fmt: skip
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
    lists = {name: _as_list(name, xs, n) for name, xs in
             [("hiddens", hiddens), ("advantages", advantages), ("masks", masks)]}  # fmt: skip
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
