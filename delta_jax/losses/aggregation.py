"""Reductions over valid tokens and responses: loss aggregations, their counts, metric means.

A per-token loss ``ℓ`` ``[B, T]`` becomes one scalar by an *aggregation*: a sum over the batch
divided by a count ``N``. Each aggregation here has the same signature::

  aggregate(per_token, mask, *, normalizer=None, segment_ids=None) -> scalar

``mask[b, t] != 0`` marks a valid token; ``per_token`` is read on valid tokens only (padding may
hold anything). ``normalizer`` is ``N``; None takes this batch's count (:func:`token_count` for
:func:`token_mean`, :func:`response_count` for the ``seq_mean_*`` ones). Both counts are sums
over tokens or responses, so the count of a batch is the sum of its micro-batches' counts: pass
the full batch's count as ``normalizer`` to every micro-batch and the micro-batch losses add up
to the full-batch loss. A count ``<= 0`` is replaced by 1 (an empty batch's loss is 0).

``segment_ids`` (optional ``[B, T]`` integers in ``[0, T]``) describe packed rows that hold
several responses: a response is then ``(row, segment id)`` instead of a row. Token-mean results
do not depend on it.

Sums run in the dtype of ``per_token``; counts are ``float32``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

Aggregate = Callable[..., Float[Array, ""]]
"""``(per_token [B, T], mask [B, T], *, normalizer=None, segment_ids=None) -> scalar``."""
Count = Callable[..., Float[Array, ""]]
"""``(mask [B, T], segment_ids=None) -> float32 scalar``: an aggregation's default ``N``."""


def valid_tokens(mask: ArrayLike) -> Bool[Array, "B T"]:
    """``mask != 0`` as booleans (a boolean mask is returned as is)."""
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def masked_mean(x: Float[Array, "B T"], mask: ArrayLike) -> Float[Array, ""]:
    """Mean of ``x`` over the valid tokens; 0 when there are none."""
    valid = valid_tokens(mask)
    n = jnp.sum(valid)
    return jnp.sum(jnp.where(valid, x, 0)) / jnp.maximum(n, 1).astype(x.dtype)


def masked_min(x: Float[Array, "B T"], mask: ArrayLike) -> Float[Array, ""]:
    """Minimum of ``x`` over the valid tokens; 0 when there are none (metrics stay finite)."""
    valid = valid_tokens(mask)
    return jnp.where(jnp.any(valid), jnp.min(jnp.where(valid, x, jnp.inf)), 0).astype(x.dtype)


def masked_max(x: Float[Array, "B T"], mask: ArrayLike) -> Float[Array, ""]:
    """Maximum of ``x`` over the valid tokens; 0 when there are none (metrics stay finite)."""
    valid = valid_tokens(mask)
    return jnp.where(jnp.any(valid), jnp.max(jnp.where(valid, x, -jnp.inf)), 0).astype(x.dtype)


def response_ids(segment_ids: ArrayLike, shape: tuple[int, ...]) -> tuple[Array, int]:
    """One integer per ``(row, segment)`` of a packed ``[B, T]`` layout, flattened ``[B·T]``,
    and how many such integers there can be."""
    seg = jnp.asarray(segment_ids)
    if seg.shape != shape or not jnp.issubdtype(seg.dtype, jnp.integer):
        raise ValueError(
            f"segment_ids must be integer with shape {shape}, got {seg.dtype}{seg.shape}"
        )
    B, T = shape
    return (jnp.arange(B)[:, None] * (T + 1) + seg).reshape(-1), B * (T + 1)


def per_response_sum(x: Float[Array, "B T"], segment_ids: ArrayLike | None) -> Float[Array, "B T"]:
    """``Σ_t x`` of each token's response, broadcast to its tokens: the row, or its segment."""
    if segment_ids is None:
        return jnp.broadcast_to(jnp.sum(x, axis=-1, keepdims=True), x.shape)
    keys, n = response_ids(segment_ids, x.shape)
    return jax.ops.segment_sum(x.reshape(-1), keys, num_segments=n)[keys].reshape(x.shape)


def token_count(mask: ArrayLike, segment_ids: ArrayLike | None = None) -> Float[Array, ""]:
    """``Σ_{b,t} mask``: the default ``N`` of :func:`token_mean` (``segment_ids`` is unused)."""
    del segment_ids  # a token is a token, however the rows are packed
    return jnp.sum(valid_tokens(mask)).astype(jnp.float32)


def response_count(mask: ArrayLike, segment_ids: ArrayLike | None = None) -> Float[Array, ""]:
    """Responses with at least one valid token: the default ``N`` of the ``seq_mean_*``."""
    valid = valid_tokens(mask)
    if segment_ids is None:
        return jnp.sum(jnp.any(valid, axis=-1)).astype(jnp.float32)
    keys, n = response_ids(segment_ids, valid.shape)
    has_tokens = jax.ops.segment_max(valid.reshape(-1).astype(jnp.int32), keys, num_segments=n)
    return jnp.sum(jnp.maximum(has_tokens, 0)).astype(jnp.float32)


def _over(total: Float[Array, ""], normalizer, count: Count, valid, segment_ids):
    """``total / N``, ``N`` = ``normalizer`` or this batch's ``count``; ``N <= 0`` reads as 1."""
    if normalizer is None:
        normalizer = count(valid, segment_ids)
    normalizer = jnp.asarray(normalizer, total.dtype)
    # Empty batch: the numerator is 0 too, and 0 is the documented loss.
    return total / jnp.where(normalizer > 0, normalizer, 1)


def token_mean(
    per_token: Float[Array, "B T"],
    mask: ArrayLike,
    *,
    normalizer: float | Float[Array, ""] | None = None,
    segment_ids: ArrayLike | None = None,
) -> Float[Array, ""]:
    """``Σ_{b,t} ℓ / N``, default ``N`` = number of valid tokens (DAPO; DELTA_SPEC §4).

    Args:
      per_token: ``[B, T]`` per-token loss ``ℓ``.
      mask: ``[B, T]`` valid-token mask (non-zero = valid).
      normalizer: ``N``; None: :func:`token_count` of ``mask``.
      segment_ids: optional ``[B, T]`` packed-row segments (the result does not depend on them).

    Returns:
      The scalar loss, in the dtype of ``per_token``.

    Examples:
      >>> import jax.numpy as jnp
      >>> float(token_mean(jnp.array([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0]]),
      ...                  jnp.array([[1, 1, 0], [1, 0, 0]])))
      2.0
    """
    valid = valid_tokens(mask)
    total = jnp.sum(jnp.where(valid, per_token, 0))
    return _over(total, normalizer, token_count, valid, segment_ids)


def seq_mean_token_mean(
    per_token: Float[Array, "B T"],
    mask: ArrayLike,
    *,
    normalizer: float | Float[Array, ""] | None = None,
    segment_ids: ArrayLike | None = None,
) -> Float[Array, ""]:
    """``Σ_b (Σ_t ℓ / |y_b|) / N``: each response's token mean, averaged over responses (GRPO).

    ``|y_b|`` is the number of valid tokens of response ``b``; default ``N`` = responses with at
    least one valid token. Arguments and result as :func:`token_mean`.

    Examples:
      >>> import jax.numpy as jnp
      >>> float(seq_mean_token_mean(jnp.array([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0]]),
      ...                           jnp.array([[1, 1, 0], [1, 0, 0]])))
      2.25
    """
    valid = valid_tokens(mask)
    per_token = jnp.where(valid, per_token, 0)
    if segment_ids is not None:  # packed rows: each token carries its response's share
        lengths = per_response_sum(valid.astype(per_token.dtype), segment_ids)
        total = jnp.sum(per_token / jnp.maximum(lengths, 1))
    else:
        per_seq = jnp.sum(per_token, axis=-1)
        total = jnp.sum(per_seq / jnp.maximum(jnp.sum(valid, axis=-1), 1).astype(per_seq.dtype))
    return _over(total, normalizer, response_count, valid, segment_ids)


def seq_mean_token_sum(
    per_token: Float[Array, "B T"],
    mask: ArrayLike,
    *,
    normalizer: float | Float[Array, ""] | None = None,
    segment_ids: ArrayLike | None = None,
) -> Float[Array, ""]:
    """``Σ_b Σ_t ℓ / N``: each response's token sum, averaged over responses.

    Default ``N`` = responses with at least one valid token. Arguments and result as
    :func:`token_mean`.
    """
    valid = valid_tokens(mask)
    per_token = jnp.where(valid, per_token, 0)
    if segment_ids is not None:
        total = jnp.sum(per_token)
    else:
        total = jnp.sum(jnp.sum(per_token, axis=-1))
    return _over(total, normalizer, response_count, valid, segment_ids)


def seq_mean_token_sum_norm(
    per_token: Float[Array, "B T"],
    mask: ArrayLike,
    *,
    max_response_length: int | None = None,
    normalizer: float | Float[Array, ""] | None = None,
    segment_ids: ArrayLike | None = None,
) -> Float[Array, ""]:
    """``Σ_b Σ_t ℓ / (C · N)`` with a constant ``C`` (Dr.GRPO, Liu et al., 2025).

    Default ``N`` = responses with at least one valid token. Other arguments and result as
    :func:`token_mean`.

    Args:
      max_response_length: ``C``; None takes ``T`` (pass it explicitly when micro-batches are
        padded to different lengths). Needed with ``segment_ids``.

    Raises:
      ValueError: ``segment_ids`` without ``max_response_length``.
    """
    valid = valid_tokens(mask)
    per_token = jnp.where(valid, per_token, 0)
    if segment_ids is not None:
        if max_response_length is None:
            raise ValueError("seq_mean_token_sum_norm with segment_ids needs max_response_length")
        total = jnp.sum(per_token / jnp.asarray(max_response_length, per_token.dtype))
    else:
        constant = valid.shape[-1] if max_response_length is None else max_response_length
        total = jnp.sum(jnp.sum(per_token, axis=-1) / jnp.asarray(constant, per_token.dtype))
    return _over(total, normalizer, response_count, valid, segment_ids)


NAMED_AGGREGATIONS: dict[str, tuple[Aggregate, Count]] = {
    "token-mean": (token_mean, token_count),
    "seq-mean-token-mean": (seq_mean_token_mean, response_count),
    "seq-mean-token-sum": (seq_mean_token_sum, response_count),
    "seq-mean-token-sum-norm": (seq_mean_token_sum_norm, response_count),
}
"""Aggregation name (``policy_loss``, config files) -> the function and its default ``N``."""
