"""Per-token log-probabilities without materialising [B, T, V] float32 logits.

The LM head is applied to chunks of ``chunk_size`` tokens (flattened over B and T) inside
``lax.map``; each chunk is wrapped in ``jax.checkpoint`` so the backward pass recomputes that
chunk's logits instead of storing them. Peak memory is therefore O(chunk_size * V) for the logits
instead of O(B * T * V), in the forward and in the backward pass.

Listed positions (``score_positions``, packed rows) are scored in chunks of a few slots of every
row at once. On XLA:CPU (``skip_empty_slots``, which the update plan sets there) a chunk with no
live slot in any row (``-1`` entries, which rows put last) is skipped (``lax.cond``), forward
and backward: a window as wide as a row costs the LM head of the slots the fullest row uses, so
one compiled program serves every step whatever its lengths. On the TPU compiler the skip cost
memory (see :func:`slot_logprobs`), so there every chunk is computed.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from delta_jax.models.attention import accumulation_dtype
from delta_jax.models.transformer import Transformer, lm_head_weight

# Default chunk: this many logits elements (512 MiB in float32) per chunk.
_CHUNK_ELEMENTS = 2**27
# Listed slots: chunks per window (:func:`slot_logprobs`; ``benchmarks/compile_once.py``).
SLOT_CHUNKS = 4


@flax.struct.dataclass
class LogprobOutput:
    """Result of :func:`token_logprobs`.

    Attributes:
      logprobs: f32[B, T], log p(targets[b, t] | tokens <= t) at the temperature.
      entropy: f32[B, T] entropy of that distribution, or None.
      hidden: [B, T, H] final normed hidden state, or None.
    """

    logprobs: Float[Array, "B T"]
    entropy: Float[Array, "B T"] | None = None
    hidden: Float[Array, "B T H"] | None = None


def token_logprobs(
    model: Transformer,
    input_ids: Int[Array, "B T"],
    targets: Int[Array, "B T"],
    *,
    attention_mask: Bool[Array, "B T"] | Int[Array, "B T"] | None = None,
    positions: Int[Array, "B T"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    parent_ids: Int[Array, "B T"] | None = None,
    temperature: float | Float[Array, ""] = 1.0,
    return_entropy: bool = False,
    return_hidden: bool = False,
    chunk_size: int | None = None,
    score_from: int = 0,
    score_positions: Int[Array, "B W"] | None = None,
    skip_empty_slots: bool = False,
) -> LogprobOutput:
    """Log-probabilities of ``targets`` under the model, chunked over tokens.

    With ``z = h W / temperature`` (``h`` the final hidden state, ``W`` the [H, V] LM head),
    ``logprob[b, t] = z[targets[b, t]] - logsumexp(z)`` and
    ``entropy[b, t] = logsumexp(z) - sum_v softmax(z)_v z_v``, all in float32 (float64 for a
    float64 model, see :func:`~delta_jax.models.attention.accumulation_dtype`).

    Args:
      model: the :class:`Transformer`.
      input_ids: int[B, T] tokens fed to the model.
      targets: int[B, T] tokens to score (usually ``input_ids`` shifted left by one); with
        ``score_positions``, int[B, W]: each slot's target (a position shared by several
        sequences, a shared prompt's last, predicts the first token of each).
      attention_mask: [B, T] real-token mask, as for the model.
      positions: int[B, T] positions, as for the model.
      segment_ids: int[B, T] packed-row segment ids (0 = padding), as for the model.
      parent_ids: int[B, T] shared-prompt segments, as for the model.
      temperature: positive scalar dividing the logits.
      return_entropy: also return the entropy of each position's distribution.
      return_hidden: also return the final hidden state [B, T, H].
      chunk_size: tokens per LM-head chunk (default: 2**27 // V).
      score_from: score only positions ``t >= score_from`` (e.g. a response after a prompt of
        that length): the LM head never runs on the others, and every output covers
        ``T - score_from`` positions.
      score_positions: int[B, W] the positions to score, per row, instead of a suffix (e.g. the
        response positions of rows packed with several sequences); a negative entry is a
        padding slot (scored at position 0, meaningless). Every output covers these ``W``
        slots; the LM head runs on nothing else.
      skip_empty_slots: with ``score_positions``, skip the chunks of slots that no row uses
        (their outputs 0): the XLA:CPU path (:func:`slot_logprobs`).

    Returns:
      :class:`LogprobOutput`; values at padded positions are finite but meaningless.

    Examples:
      >>> model = Transformer(ModelConfig.tiny())
      >>> ids = jnp.array([[1, 2, 3, 4]])
      >>> token_logprobs(model, ids[:, :-1], ids[:, 1:]).logprobs.shape
      (1, 3)
    """
    want = input_ids.shape if score_positions is None else score_positions.shape
    if targets.shape != want:
        raise ValueError(f"targets shape {targets.shape} != {want} (one per scored position)")
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not 0 <= score_from < input_ids.shape[1]:
        raise ValueError(f"score_from={score_from} must be in [0, {input_ids.shape[1]})")
    if score_positions is not None and score_from:
        raise ValueError("give score_from or score_positions, not both")
    out = model(
        input_ids,
        attention_mask=attention_mask,
        positions=positions,
        segment_ids=segment_ids,
        parent_ids=parent_ids,
        return_logits=False,
    )
    w = lm_head_weight(model).astype(model.dtype)
    if score_positions is not None:
        at = jnp.maximum(score_positions, 0)
        hidden = jnp.take_along_axis(out.hidden, at[..., None], axis=1)
        live = score_positions >= 0
        options = dict(temperature=temperature, chunk_size=chunk_size, skip=skip_empty_slots)
        lp, ent = slot_logprobs(hidden, w, targets, live, return_entropy=return_entropy, **options)
        return LogprobOutput(lp, ent, hidden if return_hidden else None)
    hidden, targets = out.hidden[:, score_from:], targets[:, score_from:]
    B, T, H = hidden.shape
    lp, ent = chunked_logprobs(
        hidden.reshape(B * T, H),
        w,
        targets.reshape(B * T),
        temperature=temperature,
        return_entropy=return_entropy,
        chunk_size=chunk_size,
    )
    return LogprobOutput(
        logprobs=lp.reshape(B, T),
        entropy=None if ent is None else ent.reshape(B, T),
        hidden=hidden if return_hidden else None,
    )


def chunked_logprobs(
    hidden: Float[Array, "M H"],
    weight: Float[Array, "H V"],
    targets: Int[Array, " M"],
    *,
    temperature: float | Float[Array, ""] = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[Float[Array, " M"], Float[Array, " M"] | None]:
    """``log_softmax(hidden @ weight / temperature)[targets]`` over M rows, chunk by chunk.

    Args:
      hidden: [M, H] rows (any float dtype; the matmul accumulates in float32, or float64).
      weight: [H, V] LM head.
      targets: int[M] ids in [0, V).
      temperature: positive scalar.
      return_entropy: also return each row's entropy.
      chunk_size: rows per chunk (default: 2**27 // V, at least 1).

    Returns:
      ``(logprobs f32[M], entropy f32[M] or None)``.
    """
    M, H = hidden.shape
    V = weight.shape[1]
    if weight.shape[0] != H:
        raise ValueError(f"weight shape {weight.shape} does not match hidden size {H}")
    chunk = max(1, _CHUNK_ELEMENTS // V) if chunk_size is None else int(chunk_size)
    if chunk <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    chunk = min(chunk, M)
    acc_dtype = accumulation_dtype(hidden.dtype)
    pad = (-M) % chunk
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, H)
    t = jnp.pad(targets, (0, pad)).reshape(-1, chunk)

    @jax.checkpoint
    def one(args):
        hc, tc = args
        z = jnp.einsum("CH,HV->CV", hc, weight, preferred_element_type=acc_dtype)
        z = z / temperature
        lse = jax.nn.logsumexp(z, axis=-1)
        lp = jnp.take_along_axis(z, tc[:, None], axis=-1)[:, 0] - lse
        if not return_entropy:
            return lp, None
        ent = lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
        return lp, ent

    lp, ent = jax.lax.map(one, (h, t))
    lp = lp.reshape(-1)[:M]
    return lp, None if ent is None else ent.reshape(-1)[:M]


def slot_logprobs(
    hidden: Float[Array, "B W H"],
    weight: Float[Array, "H V"],
    targets: Int[Array, "B W"],
    live: Bool[Array, "B W"],
    *,
    temperature: float | Float[Array, ""] = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    skip: bool = False,
) -> tuple[Float[Array, "B W"], Float[Array, "B W"] | None]:
    """:func:`chunked_logprobs` of ``W`` slots per row, chunk by chunk of slots; with ``skip``,
    chunks with no ``live`` slot in any row are skipped (their outputs are 0). The skip is for
    XLA:CPU: on the TPU compiler its ``lax.cond`` inside the map raised the train step's
    temporaries of ``configs/qwen3_8b_delta.yaml`` on v5p-64 from 72 to 97 GiB.

    A chunk is ``c`` slots of every row (rows stay whole, so a row-sharded batch stays sharded):
    ``c`` is a :data:`SLOT_CHUNKS`-th of the window (a window filled to a fraction of its width
    computes about that fraction, to a chunk), at most ``chunk_size`` (default ``2**27 // V``)
    tokens. Each chunk reads the LM head's weight again (and adds to its gradient), so fewer,
    larger chunks are cheaper where the memory allows.
    """
    B, W, H = hidden.shape
    budget = _CHUNK_ELEMENTS // weight.shape[1] if chunk_size is None else int(chunk_size)
    if budget <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    c = max(1, min(-(-W // SLOT_CHUNKS), budget // B))
    pad = (-W) % c
    acc = accumulation_dtype(hidden.dtype)

    def split(x):  # [B, W, ...] -> [W / c, B, c, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, -1, c, *x.shape[2:]), 1, 0)

    def scored(hc, tc):
        options = dict(temperature=temperature, return_entropy=return_entropy, chunk_size=B * c)
        lp, ent = chunked_logprobs(hc.reshape(B * c, H), weight, tc.reshape(B * c), **options)
        return lp, ent if return_entropy else jnp.zeros_like(lp)

    def one(args):
        hc, tc, lc = args
        if not skip:
            return scored(hc, tc)
        empty = lambda hc, tc: (jnp.zeros(B * c, acc), jnp.zeros(B * c, acc))
        return jax.lax.cond(jnp.any(lc), scored, empty, hc, tc)

    lp, ent = jax.lax.map(one, (split(hidden), split(targets), split(live)))
    join = lambda x: jnp.moveaxis(x.reshape(-1, B, c), 0, 1).reshape(B, -1)[:, :W]
    return join(lp), join(ent) if return_entropy else None
