"""Shape buckets and request validation for the sampler (host-side NumPy only, no compilation).

Every compiled sampler program has fixed shapes, so a request is padded up to buckets:

* prompt batch: number of prompts -> ``batch`` bucket (extra prompts are dummies whose rows are
  done from the start);
* prompt length: the longest prompt -> ``prompt`` bucket (prompts are left-padded);
* generation length: the largest ``max_new_tokens`` -> ``generation`` bucket.

A bucket list of None means powers of two from a floor (16 tokens, 1 prompt), so a run compiles at
most ``log2`` programs per dimension. If the prompt and generation buckets together exceed the
cache limit, the generation bucket and then the prompt bucket are clipped to what still fits
(one shape per bucket of the other dimension); a request that cannot fit is a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["Buckets", "RequestArrays", "bucket_size", "prepare_request"]


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Shape buckets of the sampler.

    Attributes:
      prompt: allowed prompt lengths (ascending), or None for powers of two >= ``min_length``.
      generation: allowed generation lengths, or None for powers of two >= ``min_length``.
      batch: allowed numbers of prompts per call, or None for powers of two.
      min_length: floor of the power-of-two length buckets.
      max_cache_length: prompt bucket + generation bucket limit; None means the model's
        ``max_position_embeddings``.
    """

    prompt: tuple[int, ...] | None = None
    generation: tuple[int, ...] | None = None
    batch: tuple[int, ...] | None = None
    min_length: int = 16
    max_cache_length: int | None = None


def bucket_size(
    size: int, buckets: Sequence[int] | None, floor: int = 1, name: str = "size"
) -> int:
    """The smallest bucket >= ``size``.

    Args:
      size: the actual size, >= 1.
      buckets: ascending allowed sizes, or None for powers of two >= ``floor``.
      floor: smallest power-of-two bucket.
      name: what ``size`` is, for the error message.

    Returns:
      The bucket.

    Raises:
      ValueError: when ``size`` exceeds the largest explicit bucket.

    Examples:
      >>> bucket_size(17, None, floor=16), bucket_size(5, (4, 8, 32))
      (32, 8)
    """
    if buckets is None:
        return max(floor, 1 << (size - 1).bit_length())
    for b in sorted(buckets):
        if b >= size:
            return b
    raise ValueError(f"{name} {size} exceeds the largest bucket {max(buckets)} of {tuple(buckets)}")


@dataclasses.dataclass(frozen=True)
class RequestArrays:
    """A validated request as bucket-shaped NumPy arrays.

    Attributes:
      prompt_ids: int32 [Bp, P] left-padded prompts (dummy prompts are one pad token).
      prompt_mask: bool [Bp, P].
      max_new: int32 [R] per-row token budget, R = Bp * n (0 for dummy rows).
      stop_ids: int32 [R, S] per-row stop ids, padded with -1.
      gen_len: the generation bucket G.
      num_rows: real rows, ``len(prompts) * n``.
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    max_new: np.ndarray
    stop_ids: np.ndarray
    gen_len: int
    num_rows: int


def _per_row(values: Sequence, num_prompts: int, n: int, name: str) -> list:
    """Expands one value per prompt to one per row; accepts one per row as is."""
    if len(values) == num_prompts:
        return [v for v in values for _ in range(n)]
    if len(values) == num_prompts * n:
        return list(values)
    raise ValueError(
        f"{name} has {len(values)} entries; expected len(prompts)={num_prompts} "
        f"or len(prompts)*n={num_prompts * n}"
    )


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_prompts(prompts, vocab_size: int) -> list[np.ndarray]:
    """The prompts as 1-D integer arrays; a ``ValueError`` naming the first bad one."""
    if not isinstance(prompts, Sequence) or isinstance(prompts, str) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists, got an empty list")
    arrays = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or a.size == 0:
            raise ValueError(
                f"prompts[{i}] must be a non-empty 1-D list of ids, got shape {a.shape}"
            )
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer ids, got dtype {a.dtype}")
        if a.min() < 0 or a.max() >= vocab_size:
            raise ValueError(
                f"prompts[{i}] has ids outside [0, {vocab_size}): min {a.min()}, max {a.max()}"
            )
        arrays.append(a)
    return arrays


def _lengths(longest: int, longest_gen: int, buckets: Buckets, limit: int) -> tuple[int, int]:
    """The prompt and generation buckets of a request, clipped to the cache limit."""
    prompt_len = bucket_size(longest, buckets.prompt, buckets.min_length, "prompt length")
    gen_len = bucket_size(longest_gen, buckets.generation, buckets.min_length, "max_new_tokens")
    if longest + longest_gen > limit:
        raise ValueError(
            f"prompt of length {longest} plus max_new_tokens {longest_gen} needs "
            f"{longest + longest_gen} cache slots, more than max_cache_length={limit}"
        )
    # Clip to the limit while keeping one shape per bucket where possible: first the generation
    # bucket, then the prompt bucket, and only then exact lengths.
    if prompt_len + gen_len > limit:
        if limit - prompt_len >= longest_gen:
            gen_len = limit - prompt_len
        elif limit - gen_len >= longest:
            prompt_len = limit - gen_len
        else:
            prompt_len, gen_len = longest, limit - longest
    return prompt_len, gen_len


def prepare_request(
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    n: int,
    stop_token_ids: Sequence[int] | Sequence[Sequence[int]],
    vocab_size: int,
    pad_id: int,
    buckets: Buckets,
    max_cache_length: int,
    row_multiple: int = 1,
) -> RequestArrays:
    """Validates a ``generate`` request and lays it out in bucket shapes.

    Args:
      prompts: non-empty list of non-empty token-id sequences.
      max_new_tokens: int, or one per prompt, or one per row; each >= 1.
      n: samples per prompt.
      stop_token_ids: one id list for all rows, or one list per prompt or per row.
      vocab_size: ids must lie in ``[0, vocab_size)``.
      pad_id: id used for padding.
      buckets: the bucket configuration.
      max_cache_length: limit on prompt bucket + generation bucket.
      row_multiple: the number of rows must be a multiple of this (mesh data shards).

    Returns:
      :class:`RequestArrays`.

    Raises:
      ValueError: naming the offending argument.
    """
    arrays = _check_prompts(prompts, vocab_size)
    num_prompts = len(arrays)

    if _is_int(max_new_tokens):
        budgets = [max_new_tokens] * (num_prompts * n)
    else:
        budgets = _per_row(list(max_new_tokens), num_prompts, n, "max_new_tokens")
    if not all(_is_int(b) and b >= 1 for b in budgets):
        raise ValueError(f"max_new_tokens must be ints >= 1, got {max_new_tokens!r}")

    stops = list(stop_token_ids)
    if all(_is_int(s) for s in stops):
        stops = [stops] * (num_prompts * n)
    else:
        stops = _per_row([list(s) for s in stops], num_prompts, n, "stop_token_ids")
    flat = [s for row in stops for s in row]
    if not all(_is_int(s) and 0 <= s < vocab_size for s in flat):
        raise ValueError(f"stop_token_ids must be ids in [0, {vocab_size}), got {stop_token_ids!r}")

    longest = max(a.size for a in arrays)
    prompt_len, gen_len = _lengths(longest, max(budgets), buckets, max_cache_length)
    batch = bucket_size(num_prompts, buckets.batch, 1, "number of prompts")
    # Rows (batch * n) must split evenly over the mesh's data shards.
    while (batch * n) % row_multiple:
        batch += 1
    rows = batch * n

    prompt_ids = np.full((batch, prompt_len), pad_id, np.int32)
    prompt_mask = np.zeros((batch, prompt_len), bool)
    for i, a in enumerate(arrays):
        prompt_ids[i, prompt_len - a.size :] = a
        prompt_mask[i, prompt_len - a.size :] = True
    # Dummy prompts hold one real pad token so that no attention row is fully masked.
    prompt_mask[num_prompts:, -1] = True

    max_new = np.zeros(rows, np.int32)
    max_new[: len(budgets)] = budgets
    width = bucket_size(max(1, max(len(s) for s in stops)), None)
    stop_ids = np.full((rows, width), -1, np.int32)
    for r, row in enumerate(stops):
        stop_ids[r, : len(row)] = row
    return RequestArrays(prompt_ids, prompt_mask, max_new, stop_ids, gen_len, num_prompts * n)
