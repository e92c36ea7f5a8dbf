"""The continuous engine's programs lowered for abstract inputs (no weights, no devices needed):
compile-only checks and cost figures for the planner on a topology without its devices (the TPU
compiler through ``jax.experimental.topologies``)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from delta_jax.models import Transformer
from delta_jax.models.axes import logical_to_mesh
from delta_jax.sampling.attention.backends import backend_for
from delta_jax.sampling.attention.paged import PAGE_AXES, PageList, PagePool
from delta_jax.sampling.engine.decode import decode_program, prefill_chunk, write_observations
from delta_jax.sampling.engine.requests import SLOT_FIELDS, Attention
from delta_jax.sampling.speculation.drafts import MAX_NGRAM, Drafts
from delta_jax.sampling.strategies import make_strategy
from delta_jax.sharding import batch_divisor, param_shardings

__all__ = ["abstract_model", "lower_decode", "lower_prefill", "lower_write"]


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


def _abstract_outputs(aval, rows: int, gen_len: int, drafted: bool = False) -> dict[str, Any]:
    """The output buffers of :func:`init_outputs` (no hidden states), ``rows`` x ``gen_len``."""
    R, G = rows, gen_len
    out = dict(
        tokens=aval((R, G), jnp.int32, ("batch",)),
        logprobs=aval((R, G), jnp.float32, ("batch",)),
        untruncated=aval((R, G), jnp.float32, ("batch",)),
    )
    if drafted:
        out["drafted"] = aval((R, G), jnp.int8, ("batch",))
    return out


def lower_decode(
    config,
    mesh: Mesh,
    rules,
    *,
    slots: int,
    steps: int,
    page_size: int,
    num_pages: int,
    table_pages: int,
    list_pages: int = 1,
    dtype: Any = jnp.bfloat16,
    attention: Attention = "pallas",
    stop_width: int = 1,
    cache_dtype: Any = None,
    rows: int | None = None,
    gen_len: int | None = None,
    stop_sequences: tuple[int, int] = (0, 0),
    draft_tokens: int = 0,
    draft_depth: int = 0,
    draft_window: int = 0,
    draft_tail: int = MAX_NGRAM,
) -> jax.stages.Lowered:
    """The decode program lowered for abstract inputs on ``mesh`` (no parameters materialised).

    For compile-only checks and cost figures on a topology without its devices (the TPU compiler
    through ``jax.experimental.topologies``): parameters in ``dtype`` placed by ``rules``.
    ``slots`` and ``num_pages`` count every data group's (the mesh's row shards); ``table_pages``
    is the page-table width (``pallas``), ``list_pages`` one group's flat page list length
    (``xla``); the pool is in ``cache_dtype`` (default ``dtype``). The output buffers hold
    ``rows`` (default ``slots``) x ``gen_len`` (default ``steps``) tokens; the chunk's length
    is a traced value (``steps`` is what a real call passes). ``stop_sequences``: the ``(Q, L)``
    shape of a multi-turn request's stop-sequence matrix (``L = 0``: none). ``draft_tokens``
    (> 0): the speculative chunk, verify steps of that many drafted tokens (a trie up to
    ``draft_depth`` deep; 0: a line) looked up in per-slot
    windows of ``draft_window`` tokens by their last ``draft_tail`` tokens (the drafter's
    ``max_ngram``).
    """
    graphdef, params, rest, aval = abstract_model(config, mesh, rules, dtype)
    i32, row = jnp.int32, ("batch",)
    groups = batch_divisor(mesh, rules)
    Q, L = stop_sequences
    packed = aval((slots, len(SLOT_FIELDS) + stop_width + L + table_pages), i32, row)
    pages = aval((groups * list_pages, 3), i32, row)
    pool_dtype = dtype if cache_dtype is None else cache_dtype
    pool = _abstract_pool(config, aval, num_pages, page_size, pool_dtype)
    out = _abstract_outputs(aval, rows or slots, gen_len or steps, draft_tokens > 0)
    fn = functools.partial(
        decode_program,
        stop_width=stop_width,
        graphdef=graphdef,
        return_hidden=False,
        pad_id=0,
        backend=backend_for(attention),
        mesh=mesh,
    )
    scalar = NamedSharding(mesh, P())
    limit = jax.ShapeDtypeStruct((), i32, sharding=scalar)
    resumable = jax.ShapeDtypeStruct((), jnp.bool_, sharding=scalar)
    seed = jax.ShapeDtypeStruct((), jnp.uint32, sharding=scalar)
    strategy = make_strategy(1.0)
    sequences = jax.ShapeDtypeStruct((Q, L), i32, sharding=scalar) if L else None
    drafts = None
    if draft_tokens:
        fn = functools.partial(
            fn,
            draft_tokens=draft_tokens,
            draft_depth=draft_depth,
            emitted_width=steps * (draft_tokens + 1),
        )
        W = (slots, draft_window)
        drafts = Drafts(aval(W, i32, row), aval(W, i32, row), aval((slots, draft_tail), i32, row))
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        return jax.jit(fn, donate_argnums=(2, 3)).lower(
            params,
            rest,
            pool,
            out,
            packed,
            pages,
            limit,
            resumable,
            seed,
            strategy,
            None,
            sequences,
            drafts,
        )


def lower_prefill(
    config,
    mesh: Mesh,
    rules,
    *,
    rows: int,
    length: int,
    page_size: int,
    num_pages: int,
    list_pages: int,
    dtype: Any = jnp.bfloat16,
    cache_dtype: Any = None,
    model: tuple | None = None,
) -> jax.stages.Lowered:
    """The prefill program (:func:`prefill_chunk`) lowered for abstract inputs on ``mesh``.

    The same program prefills a prompt (positions from 0) and continues a sequence in its own
    pages (an observation, or the context of a sequence preempted after a hand-over: positions
    from where it stopped, its pages from position 0 on in the list); the positions are values,
    the list length ``list_pages`` (one group's) is what a continuation makes longer. ``rows``
    (every group's) x ``length`` tokens per call; ``model``: the abstract ``(graphdef, params,
    rest)`` to lower with (default: the config's model in ``dtype``, placed by ``rules``); see
    :func:`lower_decode` for the rest.
    """
    graphdef, params, rest, aval = abstract_model(config, mesh, rules, dtype)
    if model is not None:
        graphdef, params, rest = model
    pool_dtype = dtype if cache_dtype is None else cache_dtype
    pool = _abstract_pool(config, aval, num_pages, page_size, pool_dtype)
    listed = batch_divisor(mesh, rules) * list_pages
    pages = PageList(*(aval((listed,), jnp.int32, ("batch",)) for _ in range(3)))
    tokens = [aval((rows, length), dt, ("batch",)) for dt in (jnp.int32, jnp.int32, jnp.bool_)]
    fn = functools.partial(prefill_chunk, graphdef=graphdef, mesh=mesh)
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        return jax.jit(fn, donate_argnums=(2,)).lower(params, rest, pool, *tokens, pages)


def lower_write(
    config, mesh: Mesh, rules, *, slots: int, width: int, rows: int, gen_len: int
) -> jax.stages.Lowered:
    """The observation write (:func:`write_observations`) lowered for abstract inputs: up to
    ``width`` ids for each of ``slots`` slots into ``rows`` x ``gen_len`` output buffers (no
    hidden states), donated as the engine donates them."""
    _, _, _, aval = abstract_model(config, mesh, rules, jnp.float32)
    out = _abstract_outputs(aval, rows, gen_len)
    row = ("batch",)
    args = (
        aval((slots,), jnp.int32, row),
        aval((slots,), jnp.int32, row),
        aval((slots, width), jnp.int32, row),
        aval((slots, width), jnp.bool_, row),
    )
    fn = functools.partial(write_observations, mesh=mesh, kv_heads=config.num_kv_heads)
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        return jax.jit(fn, donate_argnums=(0,)).lower(out, *args)
