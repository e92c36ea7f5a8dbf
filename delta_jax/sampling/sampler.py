"""Batched rollout sampler: one jitted program of prefill plus a ``lax.while_loop`` decode.

``Sampler(model).generate(prompts, max_new_tokens=...)`` runs, for a batch of token-id prompts:

1. *prefill*: the prompts, left-padded to the prompt bucket ``P``, go through the model once with a
   ``P``-slot cache; each prompt is prefilled once even when ``n > 1`` samples are drawn;
2. the prefilled K/V are repeated ``n`` times (prompt-major rows: prompt 0's ``n`` samples first)
   into the decode cache of ``P + G`` slots (``G`` the generation bucket) in the KV-cache dtype;
3. *decode*: a ``lax.while_loop`` feeds the last sampled token of every row (``T = 1``), samples
   the next one with the strategy (:mod:`delta_jax.sampling.strategies`) and writes it into
   fixed-shape ``[R, G]`` buffers with ``dynamic_update_slice``. A row is done after a stop token
   (which is kept and counted) or after its own ``max_new_tokens``; the loop exits as soon as
   every row is done, so the step counter is the longest row's length, not ``G``.

Nothing leaves the device inside the loop (no per-step host sync). The cache is created inside the
program and carried by the loop, so XLA updates it in place and it is never copied or returned;
donating a caller's buffer would buy nothing more.

Per generated token the program returns the behaviour log-prob (under the truncated distribution
the token was drawn from), the untruncated temperature-scaled log-prob (what the trainer
recomputes with ``delta_jax.models.token_logprobs``) and optionally the final hidden state that
produced the token's logits (the LM head's input, aligned like ``token_logprobs(...,
return_hidden=True)``). Logits are computed once per step from that hidden state with float32
accumulation.

Compiled programs are keyed by (prompt batch bucket, ``n``, prompt bucket, generation bucket,
stop-list width, the strategy's static fields, ``return_hidden``, parameter shapes/dtypes); each
new one is logged (``logging``, logger ``delta_jax.sampling.engine.programs``) and counted in
:attr:`Sampler.num_compilations`, in one :class:`~delta_jax.sampling.engine.programs.ProgramCache`
with the continuous engine's programs. The program itself is :mod:`delta_jax.sampling.static`.
Sampling *values* (temperature, top-p, min-p, seed, stop ids, per-row lengths) are traced and
never recompile.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from delta_jax.deprecation import warn
from delta_jax.models import Transformer
from delta_jax.models.axes import logical_to_mesh
from delta_jax.sampling.attention import NAMES, dense_cpu, resolve_attention
from delta_jax.sampling.buckets import Buckets, RequestArrays, prepare_request
from delta_jax.sampling.engine import (
    EngineRows,
    EngineSettings,
    EngineSetup,
    ProgramCache,
    RequestShape,
    Turns,
    generate_continuous,
    size_engine,
)
from delta_jax.sampling.output import Carry, SamplerOutput
from delta_jax.sampling.partial import PartialRequest, validate_partial
from delta_jax.sampling.speculation import Drafter, Speculation, speculation_for
from delta_jax.sampling.static import StaticOptions, static_program
from delta_jax.sampling.strategies import (
    make_strategy,
    strategy_signature,
    validate_sampling_args,
)
from delta_jax.sharding import SAMPLE_RULES as SAMPLING_RULES

__all__ = ["SAMPLING_RULES", "Sampler", "SamplerOutput"]


DRAFT_TOKENS = 4  # drafted tokens per verify step when speculating without draft_tokens


def _speculation_fields(sampler) -> tuple[bool | str, int, int]:
    """``(speculate, draft_tokens, draft_depth)`` of a sampler as it runs: ``speculate`` False,
    True or ``"auto"`` (the earlier spellings, ``draft_tokens=k`` alone and ``"always"``, warn
    and mean True), the drafts' fields 0 without speculation. Raises ``ValueError`` for values
    that cannot run."""
    speculate, k, depth = sampler.speculate, sampler.draft_tokens, sampler.draft_depth
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"draft_tokens must be an int >= 0, got {k!r}")
    if speculate is None:  # not given: Sampler(draft_tokens=k) speculated, for one release
        speculate = bool(k)
        if speculate:
            warn(f"Sampler(draft_tokens={k}) without speculate", "speculate=True", stacklevel=5)
    elif speculate == "always":
        warn('Sampler(speculate="always")', "speculate=True", stacklevel=5)
        speculate = True
    if not (isinstance(speculate, bool) or speculate == "auto"):
        raise ValueError(f"speculate must be True, False or 'auto', got {speculate!r}")
    if not speculate:
        return False, 0, 0
    k = DRAFT_TOKENS if k is None else k
    if k < 1:
        raise ValueError(f"speculate={speculate!r} needs draft_tokens >= 1, got {k}")
    if sampler.engine != "continuous":
        raise ValueError(
            f"speculate={speculate!r} (speculative decoding) needs engine='continuous'"
        )
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= k:
        raise ValueError(f"draft_depth must be an int in [0, draft_tokens={k}], got {depth!r}")
    return speculate, k, depth


def _validate_turns(turns, engine: str, vocab_size: int) -> None:
    """Raises ``ValueError`` for a multi-turn request the sampler cannot run."""
    if engine != "continuous":
        raise ValueError("multi-turn requests (turns=...) need Sampler(engine='continuous')")
    if not turns.stop_ids and not turns.stop_sequences:
        raise ValueError(
            "turns.stop_ids and turns.stop_sequences are empty: no token would end a turn"
        )
    bad = [t for t in turns.stop_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"turns.stop_ids {bad} are outside the vocabulary (size {vocab_size})")
    for i, seq in enumerate(turns.stop_sequences):
        where = f"turns.stop_sequences[{i}]"
        if not isinstance(seq, tuple | list) or not seq:
            raise ValueError(f"{where} must be a non-empty tuple of ids, got {seq!r}")
        bad = [t for t in seq if not isinstance(t, int | np.integer) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where} has ids {bad} outside the vocabulary (size {vocab_size})")
    if isinstance(turns.max_turns, bool) or not isinstance(turns.max_turns, int):
        raise ValueError(f"turns.max_turns must be an int >= 1, got {turns.max_turns!r}")
    if turns.max_turns < 1:
        raise ValueError(f"turns.max_turns must be an int >= 1, got {turns.max_turns!r}")


def _platform(mesh: Mesh | None) -> str:
    return (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform


def _default_cache_dtype(mesh: Mesh | None, compute_dtype: Any) -> Any:
    if jnp.dtype(compute_dtype) == jnp.float64:  # x64 numerics checks: float64 end to end
        return jnp.float64
    return jnp.float32 if _platform(mesh) == "cpu" else jnp.bfloat16


@dataclasses.dataclass(frozen=True, eq=False)
class Sampler:
    """Batched KV-cache sampler over a :class:`~delta_jax.models.Transformer`'s live parameters.

    Args:
      model: the model; its parameters are split at every call (so updates to it are seen) unless
        ``generate(params=...)`` passes a state directly.
      cache_dtype: KV-cache dtype; None means bfloat16 on accelerators and float32 on CPU.
      pad_token_id: id written after a row stops (and into left padding).
      stop_token_ids: default stop ids when ``generate`` gets none; None means the model config's
        ``eos_token_id`` (int or list) when it has one, else no stop ids.
      buckets: shape buckets and the cache limit (:class:`~delta_jax.sampling.buckets.Buckets`).
      mesh: optional device mesh; rows are then sharded by ``rules`` (``SAMPLING_RULES``).
      rules: logical-axis rules used while sampling.
      engine: ``"static"`` (one batch, prefill plus a decode loop until the longest row ends) or
        ``"continuous"`` (:mod:`delta_jax.sampling.engine`: ``decode_slots`` slots refilled as
        rows end, over a paged KV cache). Rows then have exactly ``len(prompts) * n`` entries.
      decode_slots: sequences decoded at once by the continuous engine, in total over the mesh,
        capped at the request's rows (no slot idles for want of a sequence).
        On a mesh they split evenly over its data groups (the row shards of the ``batch`` rule,
        rounded up to a multiple of them); each group runs its own slots over its own share of
        the pool, and a prompt's ``n`` samples run in one group, so ``n`` must not exceed one
        group's slots.
      page_size: tokens per KV page (continuous engine).
      num_pages: pages in the pool in total over the mesh, one scratch page per data group
        included (rounded up to a multiple of the groups, split evenly); None sizes each
        group's share for what its running sequences can hold at once, so that it never runs
        short: every slot's own pages for the largest ``max_new_tokens`` (from its prompt's
        partial last page on) plus one resident prompt (the prompt bucket) per slot, at most
        one per prompt.
      decode_chunk: decode steps per device call between two host scheduling rounds (once no
        slot can be refilled, one call runs all that is left).
      prefill_chunk: longest prompt chunk prefilled in one call.
      attention: paged attention: ``"auto"`` (the Pallas ragged paged attention kernel on TPU,
        the ``"dense"`` CPU path on CPU, else ``"xla"``), ``"xla"``, ``"pallas"`` or
        ``"dense"`` (see :mod:`delta_jax.sampling.attention.paged`).
      speculate: speculative decoding (continuous engine, every attention path), as
        ``rollout.speculate``: False decodes one token per step; True verifies up to
        ``draft_tokens`` tokens per sequence and step, drafted from the rollout's own text
        (:mod:`delta_jax.sampling.speculation.drafts`: the sequence's own text, its siblings',
        earlier calls' rollouts of the same prompt, kept by this sampler); ``"auto"`` either
        way per request
        (:class:`~delta_jax.sampling.speculation.auto_speculation.AutoSpeculation`: never on
        CPU; on accelerators the faster way as measured on this sampler's requests). The tokens
        are the same either way (greedy and sampled): a drafted token is kept only where it
        equals the token drawn at its index with that index's key. (Deprecated, for one
        release: ``draft_tokens=k > 0`` without ``speculate`` means True, as does
        ``"always"``; both warn.)
      draft_tokens: tokens drafted per sequence and verify step, ``>= 1`` when speculating
        (default 4); read as 0 without speculation.
      draft_depth: 0 drafts one line of up to ``draft_tokens`` tokens per verify step; ``d >
        0`` a trie of up to ``draft_tokens`` nodes at most ``d`` deep (the continuations most
        of the occurrences go on with; each scored position attends to its ancestors), so a
        verify step may keep one of several ways the text goes on (every attention path; on
        the TPU kernel's, :mod:`delta_jax.sampling.attention.trie_kernel`); read as 0 without
        speculation.

    Examples:
      >>> from delta_jax.models import ModelConfig
      >>> sampler = Sampler(Transformer(ModelConfig.tiny("qwen3")))
      >>> out = sampler.generate([[1, 2, 3], [4, 5]], max_new_tokens=4, temperature=0.0)
      >>> [len(t) for t in out.tokens]
      [4, 4]
    """

    model: Transformer
    cache_dtype: Any = None
    pad_token_id: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    buckets: Buckets = Buckets()
    mesh: Mesh | None = None
    rules: tuple[tuple[str, Any], ...] = SAMPLING_RULES
    engine: str = "static"
    # The engine's defaults are its settings' (the planner sizes with those).
    decode_slots: int = EngineSettings.decode_slots
    page_size: int = EngineSettings.page_size
    num_pages: int | None = EngineSettings.num_pages
    decode_chunk: int = EngineSettings.decode_chunk
    prefill_chunk: int = EngineSettings.prefill_chunk
    attention: str = "auto"
    draft_tokens: int | None = None
    draft_depth: int = 0
    speculate: bool | str | None = None  # None (not given): False, or True from draft_tokens
    _programs: ProgramCache = dataclasses.field(init=False, repr=False)
    _drafter: Drafter | None = dataclasses.field(init=False, repr=False)
    _speculation: Speculation = dataclasses.field(init=False, repr=False)

    @property
    def num_compilations(self) -> int:
        """How many programs this sampler has compiled (one per distinct bucket key)."""
        return len(self._programs)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int | list[int],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int = 0,
        stop_token_ids: list[int] | list[list[int]] | None = None,
        return_hidden: bool = False,
        params: nnx.State | None = None,
        on_sample_done: Callable[[int, list[int]], None] | None = None,
        turns: Turns | None = None,
        quota: int | None = None,
        carried: list[Carry | None] | None = None,
    ) -> SamplerOutput:
        """Samples ``n`` continuations of every prompt.

        Rows are prompt-major: row ``i * n + j`` is sample ``j`` of prompt ``i``.

        Args:
          prompts: non-empty list of non-empty token-id lists.
          max_new_tokens: an int for every row, or one int per prompt (``len(prompts)``) or per row
            (``len(prompts) * n``); each >= 1.
          n: samples per prompt, >= 1.
          temperature: 0 for greedy, else > 0 (see :mod:`delta_jax.sampling.strategies`).
          top_p: nucleus mass in (0, 1]; 1 is off.
          top_k: candidates kept, 0 is off.
          min_p: probability floor relative to the top token, in [0, 1); 0 is off.
          seed: PRNG seed; the same seed, inputs and buckets give the same samples.
          stop_token_ids: None (use the sampler's default), one list for every row, or one list per
            prompt / per row. A row stops after emitting one of its stop ids (kept in the output).
          return_hidden: also return the final hidden state that produced each token.
          params: the ``nnx.Param`` state to sample with (e.g. the trainer's current one, used
            without a copy); None splits the model's current parameters.
          on_sample_done: called as ``on_sample_done(row, tokens)`` with a row's generated ids
            once it has ended: by the continuous engine as soon as that happens, while other
            rows still decode (so their rewards can be computed meanwhile); by the static
            sampler for every row, in row order, after the batch ends.
          turns: a multi-turn request (:class:`~delta_jax.sampling.engine.requests.Turns`: the ids
            and id sequences that end a turn, the turn limit, and the host's ``submit(row, turn)``
            returning a future of the observation's ids); continuous engine only. Observations
            are written into the rows as context and marked in ``action_mask_array``.
          quota: partial rollouts (continuous engine): once this many prompts have all their
            ``n`` samples ended, the call stops after the decode chunk in which that happened;
            the rows still running or queued come back unfinished (``finished_array`` False,
            their tokens so far; every chunk then runs ``decode_chunk`` steps). None: every row
            runs to its end.
          carried: partial rollouts (continuous engine): one entry per row, None for a fresh
            row or a :class:`~delta_jax.sampling.output.Carry` (``SamplerOutput.carry``) of an
            earlier call's row: it continues from its tokens with its own RNG identity (the
            tokens an uninterrupted call would have drawn under the same weights), or, when it
            has ended (``finished``), is returned as it is. Its tokens count against the row's
            ``max_new_tokens``. Not with ``turns`` or ``return_hidden``.

        Returns:
          A :class:`~delta_jax.sampling.output.SamplerOutput`.

        Raises:
          ValueError: for an empty prompt list or prompt, an out-of-vocabulary id, invalid sampling
            parameters, or a request that does not fit the cache limit, before any compilation.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        validate_sampling_args(temperature, top_p, top_k, min_p)
        config = self.model.config
        request: RequestArrays = prepare_request(
            prompts,
            max_new_tokens=max_new_tokens,
            n=n,
            stop_token_ids=self._default_stops() if stop_token_ids is None else stop_token_ids,
            vocab_size=config.vocab_size,
            pad_id=self.pad_token_id,
            buckets=self.buckets,
            max_cache_length=self.buckets.max_cache_length or config.max_position_embeddings,
            row_multiple=self._row_multiple(),
        )
        strategy = make_strategy(temperature, top_p, top_k, min_p)
        if turns is not None:
            _validate_turns(turns, self.engine, config.vocab_size)
        carried = self._check_partial(request, n, turns, return_hidden, quota, carried)
        if self.engine == "continuous":
            arrays = [np.asarray(p, np.int32) for p in prompts]
            seed = np.uint32(seed % 2**32)
            rows = EngineRows(arrays, n, request.max_new, request.stop_ids, seed, carried)
            return self._generate_continuous(
                request, rows, strategy, return_hidden, params, on_sample_done, turns, quota
            )
        graphdef, own_params, rest = nnx.split(self.model, nnx.Param, ...)
        params = own_params if params is None else params
        args = (
            params,
            rest,
            request.prompt_ids,
            request.prompt_mask,
            request.max_new,
            request.stop_ids,
            np.uint32(seed % 2**32),
            strategy,
        )
        if self.mesh is not None:
            args = self._place(args)
        gen_len = request.gen_len
        program = self._program(args, graphdef, n, gen_len, strategy, return_hidden)
        out = program(*args)
        output = SamplerOutput(
            token_array=out["tokens"],
            logprob_array=out["logprobs"],
            untruncated_logprob_array=out["untruncated"],
            length_array=out["lengths"],
            hidden_array=out["hidden"],
            prompt_array=out["prompt_ids"],
            prompt_mask_array=out["prompt_mask"],
            num_steps=out["steps"],
            num_rows=request.num_rows,
        )
        if on_sample_done is not None:
            for row, tokens in enumerate(output.tokens):
                on_sample_done(row, tokens)
        return output

    def __post_init__(self):
        # The compiled programs of both engines (frozen dataclass: set once, here).
        object.__setattr__(self, "_programs", ProgramCache(self.mesh, self.rules))
        if self.engine not in ("static", "continuous"):
            raise ValueError(f"engine must be 'static' or 'continuous', got {self.engine!r}")
        if self.attention not in NAMES:
            names = ", ".join(repr(n) for n in NAMES)
            raise ValueError(f"attention must be one of {names}, got {self.attention!r}")
        for name in ("decode_slots", "page_size", "decode_chunk", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        speculate, k, depth = _speculation_fields(self)
        for name, value in (("speculate", speculate), ("draft_tokens", k), ("draft_depth", depth)):
            object.__setattr__(self, name, value)
        # Speculative decoding's drafts, with the history of this sampler's earlier requests
        # (a verify step emits at most depth + 1 tokens: its windows are sized for that).
        drafter = Drafter(depth or k) if speculate else None
        object.__setattr__(self, "_drafter", drafter)
        speculation = speculation_for(speculate, drafter, _platform(self.mesh))
        object.__setattr__(self, "_speculation", speculation)

    def _check_partial(self, request, n, turns, return_hidden, quota, carried):
        """The request's partial-rollout arguments checked (:func:`validate_partial`); returns
        the carried rows (None: none)."""
        partial = PartialRequest(
            self.engine,
            request.num_rows // n,
            n,
            request.max_new,
            self.model.config.vocab_size,
            multi_turn=turns is not None,
            return_hidden=return_hidden,
        )
        return validate_partial(partial, quota, carried)

    def _generate_continuous(
        self, request, rows, strategy, return_hidden, params, on_sample_done, turns, quota
    ):
        way = self._speculation.for_request()  # how this request decodes
        start = time.perf_counter()
        out, stats = generate_continuous(
            self.model,
            request,
            rows,
            strategy,
            params,
            setup=EngineSetup(
                self.engine_spec(
                    request,
                    rows.n,
                    return_hidden,
                    multi_turn=turns is not None,
                    speculative=way.drafting,
                ),
                self._programs,
                self.resolved_cache_dtype(),
                way,
            ),
            on_sample_done=on_sample_done,
            turns=turns,
            quota=quota,
        )
        self._speculation.record_request(way, time.perf_counter() - start, stats.useful_steps)
        if self.speculate:  # did this call speculate? (None: the sampler never does)
            stats = dataclasses.replace(stats, speculative=way.drafting)
        return dataclasses.replace(out, engine_stats=stats)

    def engine_spec(
        self,
        request: RequestArrays,
        n: int,
        return_hidden: bool,
        multi_turn: bool = False,
        speculative: bool = True,
    ):
        """The continuous engine's static configuration for a request's buckets
        (:func:`~delta_jax.sampling.engine.sizing.size_engine`; ``multi_turn``: the default pool
        also holds the pages of sequences waiting on the host; ``speculative`` False: decode
        steps, whatever ``draft_tokens``)."""
        k = self.draft_tokens if speculative else 0
        return size_engine(
            self.engine_settings(),
            RequestShape.of(request, n),
            return_hidden=return_hidden,
            multi_turn=multi_turn,
            draft_tokens=k,
            draft_depth=self.draft_depth,
            draft_window=self._drafter.window_size(self.decode_chunk) if k else 0,
        )

    def engine_settings(self) -> EngineSettings:
        """This sampler's continuous-engine settings, its attention path resolved for its
        platform and its mesh's data groups counted."""
        return EngineSettings(
            attention=resolve_attention(
                self.attention, _platform(self.mesh), self.model.config.head_dim
            ),
            groups=self._row_multiple(),
            decode_slots=self.decode_slots,
            page_size=self.page_size,
            num_pages=self.num_pages,
            decode_chunk=self.decode_chunk,
            prefill_chunk=self.prefill_chunk,
            min_length=self.buckets.min_length,
            pad_id=self.pad_token_id,
        )

    def resolved_cache_dtype(self) -> Any:
        """The KV-cache dtype in use (the default depends on the platform)."""
        return self.cache_dtype or _default_cache_dtype(self.mesh, self.model.dtype)

    def _default_stops(self) -> tuple[int, ...]:
        if self.stop_token_ids is not None:
            return tuple(self.stop_token_ids)
        eos = getattr(self.model.config, "eos_token_id", None)
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    def _row_multiple(self) -> int:
        """Rows must split evenly over the mesh axes the ``batch`` rule uses."""
        if self.mesh is None:
            return 1
        spec = logical_to_mesh(("batch",), self.rules, self.mesh)[0]
        axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    def _place(self, args: tuple) -> tuple:
        """Puts the per-row inputs on the mesh, sharded by rows (parameters stay where they are)."""

        def put(x: np.ndarray) -> jax.Array:
            names = ("batch",) + (None,) * (x.ndim - 1)
            spec = logical_to_mesh(names, self.rules, self.mesh, x.shape)
            return jax.device_put(x, NamedSharding(self.mesh, spec))

        params, rest, ids, mask, max_new, stops, seed, strategy = args
        return (params, rest, put(ids), put(mask), put(max_new), put(stops), seed, strategy)

    def _program(self, args, graphdef, n, gen_len, strategy, return_hidden):
        params, _, ids, _, _, stops, _, _ = args
        param_avals = tuple(
            (x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(params)
        )
        key = (
            ids.shape,
            n,
            gen_len,
            stops.shape[1],
            strategy_signature(strategy),
            return_hidden,
            # Not the graphdef itself: a config holding a dict (rope_scaling) is unhashable. The
            # parameter tree structure identifies the model layout.
            jax.tree.structure(params),
            param_avals,
        )
        cache_dtype = self.resolved_cache_dtype()
        options = StaticOptions(
            graphdef=graphdef,
            n=n,
            gen_len=gen_len,
            cache_dtype=cache_dtype,
            return_hidden=return_hidden,
            pad_id=self.pad_token_id,
            hoist_layers=dense_cpu.slices_layers_once(self.mesh),
        )
        fn = functools.partial(static_program, options=options)

        def describe() -> str:
            return (
                f"prompts={ids.shape[0]} n={n} prompt_len={ids.shape[1]} gen_len={gen_len} "
                f"stops={stops.shape[1]} mode={strategy_signature(strategy)} "
                f"hidden={return_hidden} cache={jnp.dtype(cache_dtype).name}"
            )

        return self._programs.get(key, fn, args, kind="sampler", describe=describe)
