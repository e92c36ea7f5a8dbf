"""Compiled programs: one cache for both engines, and the continuous engine's device programs.

:class:`ProgramCache` lowers, compiles, counts and logs each program once per key, under the
sampler's mesh and rules; the static sampler and the continuous engine share it
(``Sampler.num_compilations``). :class:`EnginePrograms` is the engine's device side for one
request: it owns the page pool and the output buffers (donated to every program, so XLA updates
them in place) and runs the named programs the host scheduler asks for (:meth:`prefill`,
:meth:`write`, :meth:`decode`); per decode chunk the host sends one packed slot matrix and one
page list and reads back the slots' status, nothing else.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from delta_jax.models import Transformer
from delta_jax.models.axes import logical_to_mesh
from delta_jax.sampling.attention import dense_cpu
from delta_jax.sampling.attention.backends import PagedBackend
from delta_jax.sampling.attention.paged import Tokens, init_pool
from delta_jax.sampling.engine.chunk import decode_program
from delta_jax.sampling.engine.decode import (
    DecodeOptions,
    RequestInputs,
    Weights,
    init_outputs,
    prefill_chunk,
    write_tokens,
)
from delta_jax.sampling.engine.requests import EngineSpec
from delta_jax.sampling.output import to_host
from delta_jax.sampling.speculation.drafts import Drafts
from delta_jax.sampling.strategies import strategy_signature

__all__ = ["EnginePrograms", "ProgramCache"]

logger = logging.getLogger(__name__)

READ_ROWS = 8  # rows per host read of finished outputs (one compiled gather)


class ProgramCache:
    """Compiled programs by key, each lowered and compiled once under ``mesh`` and ``rules``.

    Args:
      mesh: the device mesh the programs run on, or None (one device).
      rules: the logical-axis rules active while tracing.
    """

    def __init__(self, mesh: Mesh | None, rules):
        self.mesh, self.rules = mesh, rules
        self._compiled: dict[Hashable, Any] = {}

    def __len__(self) -> int:
        return len(self._compiled)

    def get(
        self,
        key: Hashable,
        fn: Callable,
        args: tuple,
        donate: tuple[int, ...] = (),
        *,
        kind: str = "engine",
        describe: Callable[[], str] | None = None,
    ):
        """The program of ``key``; compiles ``jax.jit(fn, donate_argnums=donate)`` for ``args``
        the first time, and logs it as ``kind``'s with ``describe()`` (default: the key)."""
        compiled = self._compiled.get(key)
        if compiled is None:
            start = time.perf_counter()
            jitted = jax.jit(fn, donate_argnums=donate)
            if self.mesh is None:
                compiled = jitted.lower(*args).compile()
            else:
                with jax.set_mesh(self.mesh), spmd.logical_axis_rules(self.rules):
                    compiled = jitted.lower(*args).compile()
            self._compiled[key] = compiled
            logger.info(
                "%s compile #%d: %s (%.2fs)",
                kind,
                len(self),
                describe() if describe is not None else key,
                time.perf_counter() - start,
            )
        return compiled

    def place(self, x: np.ndarray) -> jax.Array | np.ndarray:
        """A per-row array (or per-group page list), split over the data groups (without a
        mesh the host array goes to the compiled call as it is: no separate transfer call)."""
        if self.mesh is None:
            return x
        names = ("batch",) + (None,) * (x.ndim - 1)
        spec = logical_to_mesh(names, self.rules, self.mesh, x.shape)
        return jax.device_put(x, NamedSharding(self.mesh, spec))


class EnginePrograms:
    """The continuous engine's device programs for one request, with their state.

    Args:
      cache: the sampler's :class:`ProgramCache`.
      model: the model (its config and dtypes).
      spec: the engine call's static configuration.
      backend: its paged attention backend, bound to the cache's mesh
        (:func:`~delta_jax.sampling.attention.backends.backend_for`).
      params: the parameters to sample with (None: the model's own).
      request: the request's strategy, whether its sequences continue after a turn's end
        (multi-turn) and its ``[Q, L]`` stop-sequence matrix (NumPy, sent once) or None.
      cache_dtype: the page pool's dtype.
      width: stop ids per sequence.
      rows, gen_len: the output buffers' shape (every group's rows).
    """

    def __init__(
        self,
        cache: ProgramCache,
        model: Transformer,
        spec: EngineSpec,
        backend: PagedBackend,
        params,
        request: RequestInputs,
        *,
        cache_dtype,
        width: int,
        rows: int,
        gen_len: int,
    ):
        graphdef, own, rest = nnx.split(model, nnx.Param, ...)
        params = own if params is None else params
        self.cache, self.spec, self.params, self.rest = cache, spec, params, rest
        self.backend = backend
        self.strategy, self.width = request.strategy, width
        self.rows, self.gen_len = rows, gen_len
        self.graphdef = graphdef
        self.options = DecodeOptions.of(spec, graphdef, backend, width)
        param_avals = tuple(
            (x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(params)
        )
        self.base = (
            "engine",
            spec.slots,
            spec.page_size,
            spec.num_pages,
            jnp.dtype(cache_dtype).name,
            jax.tree.structure(params),
            param_avals,
        )
        self.hidden = model.config.hidden_size if spec.return_hidden else None
        mesh, sequences = cache.mesh, request.stop_sequences
        if sequences is not None:
            sequences = jnp.asarray(sequences)
            if mesh is not None:
                sequences = jax.device_put(sequences, NamedSharding(mesh, P()))
        self.request = request._replace(stop_sequences=sequences)
        self.pool, self.out, layers = self._setup(model, cache_dtype)
        self.weights = Weights(params, rest, layers)

    def _build(self, key: tuple, fn: Callable, args: tuple, donate=()):
        return self.cache.get(self.base + key, fn, args, donate, describe=lambda: key)

    def _setup(self, model: Transformer, cache_dtype):
        """The pool, the output buffers and, on CPU, each layer's weights sliced once for every
        program of the request (see :func:`~delta_jax.sampling.engine.chunk.decode_chunk`): one
        call."""
        spec, mesh, graphdef = self.spec, self.cache.mesh, self.graphdef
        make_pool = functools.partial(init_pool, model, spec.num_pages, spec.page_size, cache_dtype)
        drafted = spec.draft_tokens > 0
        make_out = functools.partial(
            init_outputs, self.rows, self.gen_len, self.hidden, model.dtype, spec.pad_id, drafted
        )
        cpu = dense_cpu.slices_layers_once(mesh)

        def setup(params, rest):
            layers = nnx.merge(graphdef, params, rest).layer_params() if cpu else None
            return make_pool(), make_out(), layers

        key = ("setup", self.rows, self.gen_len, self.hidden, cpu, drafted)
        args = (self.params, self.rest)
        return self._build(key, setup, args)(*args)

    def write(self, rows, cols, ids, valid, logprobs, untruncated) -> None:
        """Writes ids with their log-probs into the output buffers (per slot: output row or
        -1, first column, ids, valid, log-probs, untruncated log-probs): observations, or
        carried rows' tokens."""
        dtype = self.out["logprobs"].dtype  # float32; float64 for a float64 model
        floats = (np.asarray(x, dtype) for x in (logprobs, untruncated))
        arrays = (rows, cols, ids, valid, *floats)
        args = (self.out, *(self.cache.place(a) for a in arrays))
        key = ("write", args[3].shape, self.rows, self.gen_len, self.hidden)
        fn = functools.partial(write_tokens, groups=self.backend.groups)
        self.out = self._build(key, fn, args, (0,))(*args)

    def prefill(self, ids, positions, valid, pages) -> None:
        """Writes a chunk of tokens' K/V into their pages (as the backend reads them: a flat
        page list ``[U, 3]``, or page tables)."""
        program, args = self._prefill_program(ids, positions, valid, pages)
        self.pool = program(*args)

    def compile_prefill(self, ids, positions, valid, pages) -> None:
        """Compiles the :meth:`prefill` program of these shapes without running it."""
        self._prefill_program(ids, positions, valid, pages)

    def _prefill_program(self, ids, positions, valid, pages):
        place, backend = self.cache.place, self.backend
        pages = backend.prefill_layout(pages, place)
        tokens = Tokens(*(place(a) for a in (ids, positions, valid)))
        key = ("prefill", tokens.ids.shape, jax.tree.leaves(pages)[0].shape)
        fn = functools.partial(prefill_chunk, graphdef=self.graphdef, backend=backend)
        args = (self.weights, self.pool, tokens, pages)
        return self._build(key, fn, args, (1,)), args

    def decode(self, packed: np.ndarray, pages: np.ndarray, steps: int, refill=0) -> np.ndarray:
        """Runs up to ``steps`` decode steps (fewer once ``refill`` >= 1 rows have ended);
        returns the slots' ``[S, 4 + L]`` status."""
        return self._decode(packed, pages, steps, None, refill)["status"]

    def verify(self, packed, pages, steps: int, drafts: Drafts, refill=0):
        """Runs up to ``steps`` speculative verify steps with the chunk's ``drafts`` (NumPy);
        returns the slots' status, the tokens each emitted (``[S, E]``, -1 after them) and its
        counters (verify steps, drafted and accepted tokens by source)."""
        drafts = Drafts(*(self.cache.place(x) for x in drafts))
        result = self._decode(packed, pages, steps, drafts, refill)
        return result["status"], result["emitted"], result["counts"]

    def compile_decode(self, packed: np.ndarray, pages: np.ndarray) -> None:
        """Compiles the decode program of a chunk of these shapes (its slots and page list)
        without running it: nothing when it is compiled already."""
        self._decode_program(packed, pages, 0, None)

    def _decode(self, packed, pages, steps: int, drafts, refill: int) -> dict[str, np.ndarray]:
        program, args = self._decode_program(packed, pages, steps, drafts, refill)
        result = program(*args)
        self.pool, self.out = result.pop("pool"), result.pop("out")
        return {name: to_host(x) for name, x in result.items()}

    def _decode_program(self, packed, pages, steps: int, drafts: Drafts | None, refill=0):
        """The compiled decode (verify) program of a chunk and its arguments."""
        spec, place, sequences = self.spec, self.cache.place, self.request.stop_sequences
        packed, pages, steps = place(packed), place(pages), np.int32(steps)
        signature = (self.width, strategy_signature(self.strategy), spec.return_hidden)
        signature += (spec.attention, *(() if sequences is None else (sequences.shape,)))
        signature += (spec.draft_tokens, spec.draft_depth)  # and the drafts' shapes, if any
        signature += tuple(x.shape for x in jax.tree.leaves(drafts))
        key = ("decode", packed.shape, pages.shape, self.rows, self.gen_len, *signature)
        fn = functools.partial(decode_program, self.options)
        request = self.request._replace(refill=np.int32(refill))
        args = (self.weights, self.pool, self.out, packed, pages, steps, request, drafts)
        return self._build(key, fn, args, (1, 2)), args

    def results(self) -> dict[str, jax.Array]:
        """Hands the output buffers over (the programs cannot run after)."""
        buffers, self.out = self.out, None
        return buffers

    def peek(self, rows: np.ndarray) -> np.ndarray:
        """Tokens ``[len(rows), G]`` of finished buffer rows, on the host: read in blocks of
        ``READ_ROWS`` rows (one shape, whatever number of rows a round hands over: the gather
        compiles once)."""
        pad = np.resize(rows, -(-len(rows) // READ_ROWS) * READ_ROWS).astype(np.int32)
        tokens = self.out["tokens"]
        blocks = [
            to_host(jnp.take(tokens, self.cache.place(pad[i : i + READ_ROWS]), axis=0))
            for i in range(0, len(pad), READ_ROWS)
        ]
        return np.concatenate(blocks)[: len(rows)]
