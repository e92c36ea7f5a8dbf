"""The continuous engine's programs lowered for abstract inputs (no weights, no devices needed):
compile-only checks and cost figures for the planner on a topology without its devices (the TPU
compiler through ``jax.experimental.topologies``)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from delta_jax.models import Transformer
from delta_jax.models.axes import logical_to_mesh
from delta_jax.sampling.attention.backends import backend_for
from delta_jax.sampling.attention.paged import PAGE_AXES, Groups, PagePool, Tokens
from delta_jax.sampling.engine.chunk import decode_program
from delta_jax.sampling.engine.decode import (
    DecodeOptions,
    RequestInputs,
    Weights,
    prefill_chunk,
    write_tokens,
)
from delta_jax.sampling.engine.requests import SLOT_FIELDS, EngineSpec
from delta_jax.sampling.speculation.drafts import MAX_NGRAM, Drafts
from delta_jax.sampling.strategies import make_strategy
from delta_jax.sharding import batch_divisor, param_shardings

__all__ = ["RequestShape", "abstract_model", "lower_decode", "lower_prefill", "lower_write"]


def abstract_model(config, mesh: Mesh, rules, dtype):
    """Abstract parameters in ``dtype`` placed by ``rules`` (none materialised) and ``aval``:
    a ``ShapeDtypeStruct`` of logical axes ``names`` on ``mesh`` (missing trailing names: whole).
    """
    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, param_dtype=dtype))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    shardings = param_shardings(params, mesh, rules)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
    )

    def aval(shape, dt, names=()):
        names = tuple(names) + (None,) * (len(shape) - len(names))
        where = NamedSharding(mesh, logical_to_mesh(names, rules, mesh, shape))
        return jax.ShapeDtypeStruct(shape, dt, sharding=where)

    return graphdef, params, rest, aval


def _abstract_pool(config, aval, num_pages: int, page_size: int, dtype) -> PagePool:
    page = (num_pages, page_size, 2 * config.num_kv_heads, config.head_dim)
    return PagePool(kv=tuple(aval(page, dtype, PAGE_AXES) for _ in range(config.num_layers)))


def _abstract_outputs(
    aval, rows: int, gen_len: int, drafted: bool = False, hidden: tuple[int, Any] | None = None
) -> dict[str, Any]:
    """The output buffers of :func:`init_outputs`, ``rows`` x ``gen_len`` (with ``hidden``, the
    hidden states' ``(size, dtype)``)."""
    R, G = rows, gen_len
    out = dict(
        tokens=aval((R, G), jnp.int32, ("batch",)),
        logprobs=aval((R, G), jnp.float32, ("batch",)),
        untruncated=aval((R, G), jnp.float32, ("batch",)),
    )
    if hidden is not None:
        out["hidden"] = aval((R, G, hidden[0]), hidden[1], ("batch",))
    if drafted:
        out["drafted"] = aval((R, G), jnp.int8, ("batch",))
    return out


class RequestShape(NamedTuple):
    """What a decode program's shapes take from the request rather than from the engine's
    :class:`~delta_jax.sampling.engine.requests.EngineSpec`: the output buffers' ``rows``
    (default: the chunk's slots) x ``gen_len`` (default: ``spec.steps``) tokens, the stop ids
    per sequence, the ``(Q, L)`` shape of a multi-turn request's stop-sequence matrix
    (``L = 0``: none), and the drafter's tail (its ``max_ngram``)."""

    rows: int | None = None
    gen_len: int | None = None
    stop_width: int = 1
    stop_sequences: tuple[int, int] = (0, 0)
    draft_tail: int = MAX_NGRAM


def lower_decode(
    config,
    mesh: Mesh,
    rules,
    spec: EngineSpec,
    *,
    slots: int | None = None,
    dtype: Any = jnp.bfloat16,
    cache_dtype: Any = None,
    shape: RequestShape | None = None,
) -> jax.stages.Lowered:
    """The engine's decode program for ``spec`` lowered for abstract inputs on ``mesh`` (no
    parameters materialised): the program the engine builds for it
    (:meth:`~delta_jax.sampling.engine.decode.DecodeOptions.of`), its page layout the
    backend's.

    For compile-only checks and cost figures on a topology without its devices (the TPU compiler
    through ``jax.experimental.topologies``): parameters in ``dtype`` placed by ``rules``, the
    pool in ``cache_dtype`` (default ``dtype``). ``slots``: the chunk's slots, every data
    group's (default ``spec.slots``); the chunk's length is a traced value (``spec.steps`` is
    what a real call passes). With ``spec.draft_tokens`` the speculative chunk: verify steps
    looked up in per-slot windows of ``spec.draft_window`` tokens. ``shape``: see
    :class:`RequestShape` (default: its defaults).
    """
    shape = RequestShape() if shape is None else shape
    graphdef, params, rest, aval = abstract_model(config, mesh, rules, dtype)
    backend = backend_for(spec.attention, Groups(mesh, config.num_kv_heads))
    options = DecodeOptions.of(spec, graphdef, backend, shape.stop_width)
    S = spec.slots if slots is None else slots
    i32, row = jnp.int32, ("batch",)
    Q, L = shape.stop_sequences
    packed = aval((S, len(SLOT_FIELDS) + shape.stop_width + L + spec.max_table), i32, row)
    list_pages = backend.decode_list_pages(spec)
    pages = aval((batch_divisor(mesh, rules) * list_pages, 3), i32, row)
    pool_dtype = dtype if cache_dtype is None else cache_dtype
    pool = _abstract_pool(config, aval, spec.num_pages, spec.page_size, pool_dtype)
    hidden = (config.hidden_size, dtype) if spec.return_hidden else None
    rows, gen_len = shape.rows or S, shape.gen_len or spec.steps
    out = _abstract_outputs(aval, rows, gen_len, spec.draft_tokens > 0, hidden)
    scalar = NamedSharding(mesh, P())
    limit = jax.ShapeDtypeStruct((), i32, sharding=scalar)
    request = RequestInputs(
        strategy=make_strategy(1.0),
        resumable=jax.ShapeDtypeStruct((), jnp.bool_, sharding=scalar),
        stop_sequences=jax.ShapeDtypeStruct((Q, L), i32, sharding=scalar) if L else None,
        refill=jax.ShapeDtypeStruct((), i32, sharding=scalar),
    )
    drafts = None
    if spec.draft_tokens:
        W = (S, spec.draft_window)
        tail = aval((S, shape.draft_tail), i32, row)
        drafts = Drafts(aval(W, i32, row), aval(W, i32, row), tail)
    fn = functools.partial(decode_program, options)
    args = (Weights(params, rest), pool, out, packed, pages, limit, request, drafts)
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        return jax.jit(fn, donate_argnums=(1, 2)).lower(*args)


def lower_prefill(
    config,
    mesh: Mesh,
    rules,
    spec: EngineSpec,
    *,
    length: int,
    list_pages: int,
    dtype: Any = jnp.bfloat16,
    cache_dtype: Any = None,
    model: tuple | None = None,
    attention: str = "xla",
) -> jax.stages.Lowered:
    """The engine's prefill program (:func:`prefill_chunk`) for ``spec`` lowered for abstract
    inputs on ``mesh``: ``spec.prefill_rows`` rows (every group's) x ``length`` tokens per call,
    on the ``attention`` path: ``"xla"``, a flat page list, whatever ``spec.attention`` (the
    planner's: the compiler's cost analysis sees its attention, where it sees none of a Pallas
    kernel's, and prices more work than the kernel does), or ``"pallas"``, the TPU engine's
    (page tables ``spec.max_table`` wide; the kernel's own work is for the caller to add).

    The same program prefills a prompt (positions from 0) and continues a sequence in its own
    pages (an observation, or the context of a sequence preempted after a hand-over: positions
    from where it stopped, its pages from position 0 on in the list); the positions are values,
    the list length ``list_pages`` (one group's) is what a continuation makes longer.
    ``model``: the abstract ``(graphdef, params, rest)`` to lower with (default: the config's
    model in ``dtype``, placed by ``rules``); see :func:`lower_decode` for the rest.
    """
    graphdef, params, rest, aval = abstract_model(config, mesh, rules, dtype)
    if model is not None:
        graphdef, params, rest = model
    backend = backend_for(attention, Groups(mesh, config.num_kv_heads))
    pool_dtype = dtype if cache_dtype is None else cache_dtype
    pool = _abstract_pool(config, aval, spec.num_pages, spec.page_size, pool_dtype)
    listed = batch_divisor(mesh, rules) * list_pages

    def place(entries):  # the host's page list, abstract
        return aval(entries.shape, jnp.int32, ("batch",))

    host = (listed, 3) if attention == "xla" else (spec.prefill_rows, spec.max_table)
    pages = backend.prefill_layout(np.zeros(host, np.int32), place)
    dtypes = (jnp.int32, jnp.int32, jnp.bool_)
    tokens = Tokens(*(aval((spec.prefill_rows, length), dt, ("batch",)) for dt in dtypes))
    fn = functools.partial(prefill_chunk, graphdef=graphdef, backend=backend)
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        return jax.jit(fn, donate_argnums=(1,)).lower(Weights(params, rest), pool, tokens, pages)


def lower_write(
    config, mesh: Mesh, rules, *, slots: int, width: int, rows: int, gen_len: int
) -> jax.stages.Lowered:
    """The token write (:func:`write_tokens`: observations, carried rows) lowered for abstract
    inputs: up to ``width`` ids with their log-probs for each of ``slots`` slots into ``rows`` x
    ``gen_len`` output buffers (no hidden states), donated as the engine donates them."""
    _, _, _, aval = abstract_model(config, mesh, rules, jnp.float32)
    out = _abstract_outputs(aval, rows, gen_len)
    row = ("batch",)
    args = (
        aval((slots,), jnp.int32, row),
        aval((slots,), jnp.int32, row),
        aval((slots, width), jnp.int32, row),
        aval((slots, width), jnp.bool_, row),
        aval((slots, width), jnp.float32, row),
        aval((slots, width), jnp.float32, row),
    )
    fn = functools.partial(write_tokens, groups=Groups(mesh, config.num_kv_heads))
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        return jax.jit(fn, donate_argnums=(0,)).lower(out, *args)
