"""DelTA token coefficients: discriminative token credit assignment (DELTA_SPEC §3).

Implements the paper's self-normalised coefficients ``λ̄`` with the recipe's defaults (K = 1
refinement step, λ ∈ [0.8, 1.2], soft assignment, adaptive temperatures lagging one step,
normalisation by Σλ, token-gradient proxy ``(1 − p) h``), and the ablation options of §6.

Everything is computed from *sufficient statistics*: weighted sums of ``v`` (centroids), masses,
token counts and sums of margins / squared deviations (temperatures). A sum over tokens is the
only cross-token operation, so the same code serves the whole batch, micro-batches whose hidden
states are never one array (the sums run over the list), and sharded batches (the sums are
all-reduced over a mesh axis for ``scope="global"``, or left per shard for ``"per_shard"``,
which reproduces the reference recipe).

The margin uses the cheap exact form ``‖v − μ−‖² − ‖v − μ+‖² = 2 v·(μ+ − μ−) − (‖μ+‖² − ‖μ−‖²)``
and ``v = (1 − p) h``, so a refinement step is one projection ``h · d`` and one weighted sum
``Σ w (1 − p) h``: no ``[B, T, H]`` array is created besides ``hidden`` itself (see
``_delta_proxy`` for bf16 on CPU/GPU), and the whole computation is ``2 (K + 1)`` mat-vec sweeps
over ``hidden``, ``O(B·T·H·(K + 1))`` flops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from delta_jax.losses._delta_proxy import HiddenTopk, LmHeadRow
from delta_jax.losses._delta_validate import Chunk, check_call, check_chunks
from delta_jax.losses.options import DeltaOptions, TopkInputs, apply_legacy_keywords


def _compute_dtype(chunks: list[Chunk], lm_head: Array | None) -> jnp.dtype:
    """float32 for any low-precision input; float64 when an input is (x64 numerics checks)."""
    arrays = [lm_head, *(x for c in chunks for x in (c.hidden, c.logprobs, c.topk_logits))]
    return jnp.result_type(jnp.float32, *(x.dtype for x in arrays if x is not None))


def _proxy(chunks: list[Chunk], masks: list[Array], lm_head: Array | None, opts: DeltaOptions, ft):
    """The token-gradient proxy ``v`` of ``opts.proxy`` over the chunks (``_delta_proxy``)."""
    if opts.proxy == "lm_head_row":
        scales = [
            jnp.where(m, -jnp.expm1(c.logprobs.astype(ft)), 0.0)
            for c, m in zip(chunks, masks, strict=True)
        ]
        return LmHeadRow([c.hidden for c in chunks], scales)
    probs = []
    for c, m in zip(chunks, masks, strict=True):
        valid = m[..., None]
        logits = jnp.where(valid, c.topk_logits.astype(ft), 0.0)
        probs.append(jnp.where(valid, jax.nn.softmax(logits, axis=-1), 0.0))
    token_ids = [c.token_ids for c in chunks]
    return HiddenTopk(lm_head, token_ids, [c.topk_ids for c in chunks], probs, masks)


class _Sides:
    """The batch's valid tokens split into the positive side P and the negative side N.

    Per chunk, arrays ``[2, b, T]`` carry P on row 0 and N on row 1. Every statistic of
    DELTA_SPEC §3 is a sum over tokens (:meth:`total`), all-reduced over ``opts.axis_name`` for
    the global scope, so the methods read as the spec's formulas whatever the chunking.
    """

    def __init__(self, chunks: list[Chunk], lm_head: Array | None, opts: DeltaOptions):
        self.opts = opts
        self.ft = ft = _compute_dtype(chunks, lm_head)
        self.masks = [c.mask != 0 for c in chunks]
        # Per-token advantages [b, T]: a per-response [b] one is broadcast along its tokens.
        advs = [
            jnp.broadcast_to(c.advantages.astype(ft).reshape(c.mask.shape[0], -1), c.mask.shape)
            for c in chunks
        ]
        self.proxy = _proxy(chunks, self.masks, lm_head, opts, ft)
        self.sides, self.masses = [], []  # token sets P / N, and the weights a± on them
        for a, m in zip(advs, self.masks, strict=True):
            side = jnp.stack([m & (a > 0), m & (a < 0)])
            self.sides.append(side)
            self.masses.append(jnp.where(side, jnp.abs(a)[None], 0.0))
        # Integer counts stay exact beyond 2**24 tokens.
        self.n_side = self.total(self.sides).astype(ft)  # [2]
        self.n_valid = self.total(self.masks).astype(ft)
        self.per_side = jnp.maximum(self.n_side, 1.0)

    def reduce(self, x: Array) -> Array:
        """All-reduced over the batch's mesh axis for global statistics inside ``shard_map``."""
        if self.opts.scope == "global" and self.opts.axis_name is not None:
            return jax.lax.psum(x, self.opts.axis_name)
        return x

    def total(self, chunked: list[Array]) -> Array:
        """Sum over every token of every chunk (their last two axes)."""
        return self.reduce(sum(jnp.sum(x, axis=(-2, -1)) for x in chunked))

    def on_sides(self, chunked: list[Array]) -> list[Array]:
        """Zero outside each side's own tokens."""
        return [jnp.where(s, x, 0.0) for s, x in zip(self.sides, chunked, strict=True)]

    def centroids(self, weights: list[Array]) -> Float[Array, "2 H"]:
        """``μ± = Σ w v / max(Σ w, ε)`` of each side."""
        sums = self.reduce(self.proxy.weighted_sums(weights))
        return sums / jnp.maximum(self.total(weights), self.opts.eps)[:, None]

    def margins(self, mu: Float[Array, "2 H"]) -> list[Array]:
        """``Δ+ = 2 v·(μ+ − μ−) − (‖μ+‖² − ‖μ−‖²)`` on row 0 and ``Δ− = −Δ+`` on row 1."""
        offset = jnp.dot(mu[0], mu[0]) - jnp.dot(mu[1], mu[1])
        projections = self.proxy.project(mu[0] - mu[1])
        return [jnp.stack([2.0 * p - offset, offset - 2.0 * p]) for p in projections]

    def temperature(self, deltas: list[Array]) -> Float[Array, " 2"]:
        """``γ± = sqrt(max(Var(Δ±), ε))``: population std of each side's margins, two passes."""
        mean = (self.total(self.on_sides(deltas)) / self.per_side)[:, None, None]
        spread = self.total(self.on_sides([jnp.square(d - mean) for d in deltas]))
        return jnp.sqrt(jnp.maximum(spread / self.per_side, self.opts.eps))

    def assign(self, deltas: list[Array], gamma: Float[Array, " 2"]) -> list[Array]:
        """Soft ``α = σ(Δ/γ)`` or hard ``α = [Δ > 0]`` assignment to the own side."""
        if self.opts.assignment == "hard":
            return [(d > 0).astype(self.ft) for d in deltas]
        return [jax.nn.sigmoid(d / gamma[:, None, None]) for d in deltas]


def _refine(sides: _Sides):
    """Centroids, their margins and the temperature after K refinements (§3 steps 1-4)."""
    opts = sides.opts
    mu = sides.centroids(sides.masses)
    deltas = sides.margins(mu)
    gamma_now = sides.temperature(deltas)  # temperature of the current margins
    gamma = gamma_now  # temperature the next scores use: lags the margins by one step
    for step in range(opts.refine_steps):
        alpha = sides.assign(deltas, gamma)
        if opts.adaptive_gamma:
            gamma = gamma_now
        mu = sides.centroids([w * a for w, a in zip(sides.masses, alpha, strict=True)])
        deltas = sides.margins(mu)
        if opts.adaptive_gamma and step + 1 < opts.refine_steps:
            gamma_now = sides.temperature(deltas)
    return mu, deltas, gamma


def _lambdas(sides: _Sides, alpha: list[Array]) -> list[Array]:
    """``λ`` from the final scores, self-normalised to mean 1 (§3 steps 6-7)."""
    opts, lams = sides.opts, []
    for s, m, a in zip(sides.sides, sides.masks, alpha, strict=True):
        scored = s[0] | s[1]
        score = jnp.where(s[0], a[0], a[1])
        if opts.range_map:
            lam = opts.lam_min + (opts.lam_max - opts.lam_min) * score
            lams.append(jnp.where(scored, lam, jnp.where(m, opts.lam_min, 0.0)))
        else:
            lams.append(jnp.where(scored, score, 0.0))
    if opts.normalize == "sum":
        scale = sides.n_valid / jnp.maximum(sides.total(lams), opts.eps)
        lams = [lam * scale for lam in lams]
    return lams


def _diagnostics(sides: _Sides, mu, deltas, gamma, lams) -> dict[str, Array]:
    """The scalars of ``return_diagnostics`` (see :func:`delta_coefficients`)."""
    per_side, eps = sides.per_side, sides.opts.eps
    norms = jnp.sqrt(jnp.sum(jnp.square(mu), axis=-1))
    above = sides.total([s & (lam[None] > 1.0) for s, lam in zip(sides.sides, lams, strict=True)])
    agree = sides.total([s & (d > 0) for s, d in zip(sides.sides, deltas, strict=True)])
    return {
        "gamma_pos": gamma[0],
        "gamma_neg": gamma[1],
        "centroid_norm_pos": norms[0],
        "centroid_norm_neg": norms[1],
        "centroid_cosine": jnp.dot(mu[0], mu[1]) / jnp.maximum(norms[0] * norms[1], eps),
        "frac_above_one_pos": above[0] / per_side[0],
        "frac_above_one_neg": above[1] / per_side[1],
        "sign_accuracy": jnp.sum(agree) / jnp.maximum(jnp.sum(sides.n_side), 1.0),
    }


def _solve(chunks: list[Chunk], lm_head: Array | None, opts: DeltaOptions):
    """Coefficients (per chunk) and diagnostics from the chunks' sufficient statistics."""
    chunks, lm_head = jax.lax.stop_gradient((chunks, lm_head))
    sides = _Sides(chunks, lm_head, opts)
    mu, deltas, gamma = _refine(sides)
    lams = _lambdas(sides, sides.assign(deltas, gamma))
    return lams, _diagnostics(sides, mu, deltas, gamma, lams)


def _run(chunks: list[Chunk], lm_head: Array | None, opts: DeltaOptions, mesh: Any):
    if mesh is None:
        return _solve(chunks, lm_head, opts)
    names = opts.axis_name if isinstance(opts.axis_name, tuple) else (opts.axis_name,)
    shards = math.prod(mesh.shape[n] for n in names)
    for i, c in enumerate(chunks):
        if c.mask.shape[0] % shards:
            raise ValueError(
                f"mask[{i}] batch size {c.mask.shape[0]} is not divisible by the {shards} shards "
                f"of mesh axis {opts.axis_name!r}"
            )
    batch = jax.sharding.PartitionSpec(opts.axis_name)
    replicated = jax.sharding.PartitionSpec()
    per_shard = opts.scope == "per_shard"

    def body(chunks, lm_head):
        lams, diagnostics = _solve(chunks, lm_head, opts)
        if per_shard:  # one value per shard, stacked along a leading shard axis
            diagnostics = {k: v[None] for k, v in diagnostics.items()}
        return lams, diagnostics

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(batch, replicated),
        out_specs=(batch, batch if per_shard else replicated),
    )(chunks, lm_head)


def delta_coefficients_microbatched(
    hiddens: Sequence[ArrayLike] | None,
    logprobs: Sequence[ArrayLike],
    advantages: Sequence[ArrayLike],
    masks: Sequence[ArrayLike],
    options: DeltaOptions = DeltaOptions(),
    *,
    topk: TopkInputs | None = None,
    mesh: jax.sharding.Mesh | None = None,
    return_diagnostics: bool = False,
    **legacy: Any,
):
    """DelTA coefficients of a rollout batch given as micro-batches, exactly as one batch.

    Micro-batch ``i`` holds ``b_i`` responses of ``T_i`` positions (both may differ between
    micro-batches). The statistics of DELTA_SPEC §3 are sums over tokens, so each of the
    ``2 (K + 1)`` sweeps (K + 1 projections, K + 1 weighted sums) runs over every stored
    micro-batch before the next one starts; the result equals :func:`delta_coefficients` on the
    concatenated batch up to float summation order, including the normalisation over the whole
    batch. No model forward is re-run: the caller keeps each micro-batch's final hidden states
    from the forward it makes anyway (e.g. in bf16).

    Memory: the kept hidden states, ``Σ_i b_i · T_i · H · bytes``. For example 32 responses of
    8192 tokens per device with ``H = 4096`` in bf16 keep 2 GiB; the computation itself adds
    only ``O(Σ b_i T_i + H)`` float32 scalars (on TPU; JAX's CPU/GPU lowerings of a bf16 dot
    with float32 accumulation also convert the operand, one micro-batch at a time).

    Args:
      hiddens: per micro-batch ``[b_i, T_i, H]`` hidden states; may be ``None`` with
        ``proxy="hidden_topk"``.
      logprobs: per micro-batch ``[b_i, T_i]`` old-policy log-probs of the sampled tokens.
      advantages: per micro-batch ``[b_i]`` sequence advantages (or ``[b_i, T_i]`` per token).
      masks: per micro-batch ``[b_i, T_i]``, nonzero on real response tokens.
      options: the :class:`~delta_jax.losses.DeltaOptions`.
      topk: with ``proxy="hidden_topk"``, a :class:`~delta_jax.losses.TopkInputs` whose
        ``token_ids`` / ``topk_logits`` / ``topk_ids`` are sequences, one per micro-batch.
      mesh: as for :func:`delta_coefficients`.
      return_diagnostics: as for :func:`delta_coefficients`.
      **legacy: the options as loose keywords (``refine_steps=2``, ``lm_head=...``), the
        earlier form: deprecated, they warn and are applied on top of ``options`` / ``topk``.

    Returns:
      A list of float32 ``[b_i, T_i]`` coefficients, and the diagnostics dict when
      ``return_diagnostics``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from delta_jax.losses import delta_coefficients_microbatched
      >>> hs = [jnp.ones((2, 3, 4), jnp.bfloat16), jnp.ones((2, 5, 4), jnp.bfloat16)]
      >>> lps = [jnp.full((2, 3), -1.0), jnp.full((2, 5), -2.0)]
      >>> advs = [jnp.array([1.0, -1.0]), jnp.array([0.5, 0.0])]
      >>> ms = [jnp.ones((2, 3)), jnp.ones((2, 5))]
      >>> coefs = jax.jit(delta_coefficients_microbatched)(hs, lps, advs, ms)
      >>> [c.shape for c in coefs]
      [(2, 3), (2, 5)]
    """
    options, topk = apply_legacy_keywords(
        "delta_coefficients_microbatched", legacy, options, topk, TopkInputs, "topk"
    )
    check_call(options, mesh, return_diagnostics)
    n = len(logprobs)
    chunks, lm_head = check_chunks(
        options.proxy,
        hiddens=[None] * n if hiddens is None else hiddens,
        logprobs=logprobs,
        advantages=advantages,
        masks=masks,
        topk=topk,
        indexed=True,
    )
    lams, diagnostics = _run(chunks, lm_head, options, mesh)
    return (lams, diagnostics) if return_diagnostics else lams


def delta_coefficients(
    hidden: Float[ArrayLike, "B T H"] | None,
    logprobs: Float[ArrayLike, "B T"],
    advantages: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    mask: ArrayLike,
    options: DeltaOptions = DeltaOptions(),
    *,
    topk: TopkInputs | None = None,
    mesh: jax.sharding.Mesh | None = None,
    return_diagnostics: bool = False,
    **legacy: Any,
):
    r"""Self-normalised DelTA token coefficients ``λ̄`` (DELTA_SPEC §3).

    With ``v = (1 − p) h``, sides ``P = {Â > 0}``, ``N = {Â < 0}``, ``Z = {Â = 0}`` (valid
    tokens) and weights ``a± = max(±Â, 0)``::

      μ± = Σ a± v / max(Σ a±, ε)                                 (initial centroids)
      Δ+ = ‖v − μ−‖² − ‖v − μ+‖² = 2 v·(μ+ − μ−) − (‖μ+‖² − ‖μ−‖²),   Δ− = −Δ+
      γ± = sqrt(max(Var_{P|N}(Δ±), ε))                          (population, unweighted)
      K times:  α = σ(Δ±/γ±);  μ± ← Σ a± α v / max(Σ a± α, ε);  γ± ← γ of the margins at the
                start of the step (the temperature lags one step)
      λ = λ_min + (λ_max − λ_min) σ(Δ±(μ*)/γ±) on P ∪ N,  λ_min on Z,  0 on padding
      λ̄ = λ · |valid| / max(Σ λ, ε)

    Everything is under ``stop_gradient``; the result is float32 for any input dtype (a bf16
    ``hidden`` is multiplied with float32 accumulation, so the result is the float32 computation
    on its stored values), or float64 when an input is float64 (x64 mode, numerics checks).

    Degenerate inputs never give NaN/inf: an empty side (e.g. only positive advantages) has
    centroid 0 and ``γ = sqrt(ε)``, so the other side is scored against the origin; all
    advantages zero gives ``λ̄ = 1`` on every valid token (``λ_min > 0``); an empty mask gives
    all zeros; a single scored token gives ``λ̄ = 1``. With ``range_map=False`` and no token in
    P ∪ N, or ``λ_min = 0`` and only Z tokens, ``Σλ = 0`` and ``λ̄ = 0``. Padded positions may
    hold any finite values.

    Args:
      hidden: ``[B, T, H]`` final hidden states (after the final norm) of the response
        positions, any float dtype. With ``proxy="hidden_topk"`` it is not used and may be None
        (if given, its shape is checked against ``lm_head``).
      logprobs: ``[B, T]`` old-policy log-probs of the sampled tokens.
      advantages: ``[B]`` sequence-level advantages ``Â``, or ``[B, T]`` per token (packed rows
        holding several responses: each token carries its response's advantage; every
        statistic is a sum over tokens, so the result does not depend on the layout).
      mask: ``[B, T]``, nonzero on real response tokens.
      options: the :class:`~delta_jax.losses.DeltaOptions` (K, the λ range, assignment,
        temperatures, normalisation, statistics scope and axis, proxy, ε); the defaults are
        the reference recipe's.
      topk: the arrays of ``proxy="hidden_topk"``, a :class:`~delta_jax.losses.TopkInputs`
        (LM-head weight, sampled ids, top-k logits and ids); None for ``"lm_head_row"``.
      mesh: if given (with ``options.axis_name``), the computation is wrapped in
        ``jax.shard_map`` over ``mesh`` with the batch dimension split over ``axis_name``: the
        convenient way to get per-shard statistics from plain ``jit`` code. Per-shard
        diagnostics then carry a leading shard axis.
      return_diagnostics: also return a dict of float32 scalars: ``gamma_pos``/``gamma_neg``
        (temperatures of the final scores), ``centroid_norm_pos``/``_neg`` and
        ``centroid_cosine`` (refined centroids), ``frac_above_one_pos``/``_neg`` (fraction of
        the side's tokens with ``λ̄ > 1``) and ``sign_accuracy`` (fraction of P ∪ N tokens
        whose final margin ``Δ±`` is positive); 0 for empty sides.
      **legacy: the options as loose keywords (``refine_steps=2``, ``lm_head=...``), the
        earlier form: deprecated, they warn and are applied on top of ``options`` / ``topk``.

    Returns:
      float32 ``[B, T]`` coefficients ``λ̄`` (0 on padding), and the diagnostics dict when
      ``return_diagnostics``.

    Raises:
      ValueError: on mismatched shapes, non-float ``hidden``/``logprobs``, or invalid options.
      TypeError: on a keyword that is neither an argument nor a legacy option.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from delta_jax.losses import delta_coefficients
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> hidden = jax.random.normal(k1, (4, 6, 8), jnp.bfloat16)
      >>> logprobs = -jax.random.uniform(k2, (4, 6))
      >>> advantages = jnp.array([1.0, 0.5, -0.5, -1.0])
      >>> mask = jnp.ones((4, 6)).at[0, 4:].set(0)
      >>> coef = jax.jit(delta_coefficients)(hidden, logprobs, advantages, mask)
      >>> coef.shape, coef.dtype, round(float(coef.sum() / mask.sum()), 4)
      ((4, 6), dtype('float32'), 1.0)
      >>> from delta_jax.losses import DeltaOptions
      >>> k2 = delta_coefficients(hidden, logprobs, advantages, mask, DeltaOptions(refine_steps=2))
    """
    options, topk = apply_legacy_keywords(
        "delta_coefficients", legacy, options, topk, TopkInputs, "topk"
    )
    check_call(options, mesh, return_diagnostics)
    if topk is not None:  # one batch: each per-token array as a list of one micro-batch
        topk = TopkInputs(topk.lm_head, *(None if x is None else [x] for x in topk[1:]))
    chunks, lm_head = check_chunks(
        options.proxy,
        hiddens=[hidden],
        logprobs=[logprobs],
        advantages=[advantages],
        masks=[mask],
        topk=topk,
        indexed=False,
    )
    lams, diagnostics = _run(chunks, lm_head, options, mesh)
    return (lams[0], diagnostics) if return_diagnostics else lams[0]
