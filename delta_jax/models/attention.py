"""Causal self-attention over packed rows, behind one function with several implementations.

Every implementation computes the same thing: for queries ``q [B, T, N, D]`` and keys / values
``k, v [B, T, K, D]`` (grouped-query attention, ``N % K == 0``; query head n reads key head
``n // (N / K)``), token t attends to the tokens ``s <= t`` of its own segment::

    out[t] = softmax_s(q[t] . k[s] / sqrt(D), over s <= t with seg[s] == seg[t]) @ v[s]

``segment_ids [B, T]`` numbers the sequences packed into a row; 0 is padding, which forms a
segment of its own, so every query sees at least itself and no row of the softmax is empty (the
outputs at padded positions are finite and meaningless; losses mask them).

A shared prompt (``parent_ids [B, T]``, optional): a row may hold a prompt once followed by
several of its responses, each a segment of its own whose tokens name the prompt's segment as
their parent (a token with no shared prompt is its own parent). Token t then also sees the
tokens ``s <= t`` of its parent segment::

    visible(t, s) = s <= t and seg[s] in (seg[t], parent[t])

Implementations (``model.attention``):

* ``dense``: the full ``[B, K, G, T, T]`` float32 score matrix (see
  :func:`accumulation_dtype`). Short sequences.
* ``chunked``: pure XLA, blocks of ``block`` queries against blocks of ``block`` keys with an
  online softmax; each query block is rematerialised in the backward pass, so forward and
  backward memory are ``O(T x block)`` per head. Any backend; the CPU path for long sequences.
* ``splash``: JAX's Pallas TPU splash-attention kernel, under ``jax.shard_map`` over the mesh's
  batch and head axes (Pallas kernels are not partitioned automatically). Off TPU it runs in
  Pallas interpret mode: slow, for testing the exact TPU code path.
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on a CUDA GPU.
* ``auto``: splash on TPU, cudnn on GPU, dense on CPU up to :data:`DENSE_MAX_LENGTH` tokens and
  chunked above; the choice is logged.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import jax
import jax.numpy as jnp
from flax.core import spmd
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from delta_jax.models import axes as ax

Impl = Literal["auto", "dense", "chunked", "splash", "cudnn"]
IMPLS: tuple[str, ...] = ("auto", "dense", "chunked", "splash", "cudnn")
# On CPU, ``auto`` uses dense attention up to this many tokens per row and chunked above.
DENSE_MAX_LENGTH = 1024
# Pallas TPU kernels tile sequences in multiples of the 128-lane vector width.
SPLASH_BLOCK_MULTIPLE = 128

_log = logging.getLogger(__name__)
_NEG = float(jnp.finfo(jnp.float32).min)


def accumulation_dtype(dtype) -> jnp.dtype:
    """float32, or ``dtype`` if wider: softmax, RMSNorm statistics and logits are computed in it.

    bf16 / f32 models compute in float32 exactly as ``transformers`` does; a float64 model (x64
    mode, used by numerics tests) stays float64 end to end.
    """
    return jnp.promote_types(dtype, jnp.float32)


def attention(
    q: Float[Array, "B T N D"],
    k: Float[Array, "B T K D"],
    v: Float[Array, "B T K D"],
    segment_ids: Int[Array, "B T"],
    *,
    parent_ids: Int[Array, "B T"] | None = None,
    impl: Impl = "auto",
    block: int = 512,
    name: str | None = None,
) -> Float[Array, "B T N D"]:
    """Causal grouped-query attention within segments (see the module docstring).

    Args:
      q: queries [B, T, N, D] (after RoPE).
      k: keys [B, T, K, D] (after RoPE).
      v: values [B, T, K, D].
      segment_ids: int[B, T], the sequence each token belongs to; 0 = padding.
      parent_ids: int[B, T], the segment of the shared prompt each token continues (itself
        where none), or None: no shared prompts.
      impl: one of :data:`IMPLS`.
      block: query / key block length of ``chunked`` and ``splash`` (``model.attention_block``).
      name: ``checkpoint_name`` of the splash kernel's residuals (its output and log-sum-exp),
        so that a remat policy can keep them instead of running the kernel again.

    Returns:
      [B, T, N, D] in the dtype of ``q``.
    """
    impl = resolve_impl(impl, q.shape[1], _platform())
    if impl == "dense":
        return dense(q, k, v, segment_ids, parent_ids)
    if impl == "chunked":
        return chunked(q, k, v, segment_ids, parent_ids, block=block)
    if impl == "splash":
        return splash(q, k, v, segment_ids, parent_ids, block=block, name=name)
    if impl == "cudnn":
        return cudnn(q, k, v, segment_ids, parent_ids)
    raise ValueError(f"model.attention={impl!r}; expected one of {IMPLS}")


def resolve_impl(impl: str, length: int, platform: str) -> str:
    """The implementation ``impl`` stands for on ``platform`` at ``length`` tokens (logs auto)."""
    if impl not in IMPLS:
        raise ValueError(f"model.attention={impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    if platform == "tpu":
        chosen = "splash"
    elif platform == "gpu":
        chosen = "cudnn"
    else:
        chosen = "dense" if length <= DENSE_MAX_LENGTH else "chunked"
    _log.info("model.attention=auto: %s on %s at %d tokens per row", chosen, platform, length)
    return chosen


def check_block(block: int) -> None:
    """Raises the one-line error for a ``model.attention_block`` the splash kernel rejects."""
    if block <= 0 or block % SPLASH_BLOCK_MULTIPLE:
        raise ValueError(
            f"model.attention_block={block}: the splash kernel needs a positive multiple of "
            f"{SPLASH_BLOCK_MULTIPLE} (e.g. 128, 256, 512)"
        )


def _platform() -> str:
    # The mesh being traced for decides (compile-only TPU planning runs with a CPU default
    # backend); without a mesh, the default backend.
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.abstract_device is not None:
        return mesh.abstract_device.platform
    return jax.default_backend()


def visible(segment_ids: Int[Array, "B T"], parent_ids: Int[Array, "B T"] | None = None):
    """bool[B, T, T]: query t may attend to key s (``s <= t``, in t's segment or its parent's)."""
    T = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    return causal[None] & sees(segment_ids, parent_ids, segment_ids)


def sees(seg_q, parent_q, seg_k) -> jax.Array:
    """bool[B, Tq, Tk]: key segment in the query's segment or its parent's (causality aside)."""
    same = seg_q[:, :, None] == seg_k[:, None, :]
    return same if parent_q is None else same | (parent_q[:, :, None] == seg_k[:, None, :])


def dense(q, k, v, segment_ids, parent_ids=None):
    """Attention with the whole score matrix materialised (float32 scores and softmax)."""
    B, T, N, D = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, N // K, D)
    acc_dtype = accumulation_dtype(q.dtype)
    scores = jnp.einsum("BTKGD,BSKD->BKGTS", q, k, preferred_element_type=acc_dtype)
    scores = jnp.where(visible(segment_ids, parent_ids)[:, None, None], scores * D**-0.5, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("BKGTS,BSKD->BTKGD", probs, v).reshape(B, T, N, D)


def _pad_length(x, length: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def chunked(q, k, v, segment_ids, parent_ids=None, *, block: int = 512):
    """Blockwise attention with an online softmax; memory ``O(T x block)`` forward and backward.

    Queries are split into blocks of ``block``; each query block runs a scan over the key blocks
    carrying the running max ``m``, normaliser ``norm`` and weighted sum ``acc`` (float32), and
    skips key blocks entirely after it (causality). The query block is ``jax.checkpoint``-ed: the
    backward pass keeps only its inputs and recomputes its key scan, so at most one query
    block's ``[block, T]`` scores are alive at a time.
    """
    B, T, N, D = q.shape
    K = k.shape[2]
    G = N // K
    block = min(block, T)
    Tp = -(-T // block) * block
    n = Tp // block
    # Appended tokens (segment 0, after every real token) are invisible to the real queries.
    q, k, v, seg = (_pad_length(x, Tp) for x in (q, k, v, segment_ids))
    par = seg if parent_ids is None else _pad_length(parent_ids, Tp)
    qb = q.reshape(B, n, block, K, G, D).swapaxes(0, 1)  # [n, B, bq, K, G, D]
    kb = k.reshape(B, n, block, K, D).swapaxes(0, 1)  # [n, B, bk, K, D]
    vb = v.reshape(B, n, block, K, D).swapaxes(0, 1)
    sb = seg.reshape(B, n, block).swapaxes(0, 1)  # [n, B, block]
    pb = par.reshape(B, n, block).swapaxes(0, 1)
    scale = D**-0.5
    acc_dtype = accumulation_dtype(q.dtype)

    @jax.checkpoint
    def query_block(args):
        i, q_i, seg_q, par_q = args
        pos_q = i * block + jnp.arange(block)

        def key_block(carry, xs):
            j, k_j, v_j, seg_k = xs
            pos_k = j * block + jnp.arange(block)

            def update(carry):
                m, norm, acc = carry
                s = jnp.einsum("BTKGD,BSKD->BKGTS", q_i, k_j, preferred_element_type=acc_dtype)
                see = (pos_q[:, None] >= pos_k[None, :]) & sees(seg_q, par_q, seg_k)
                see = see[:, None, None]  # [B, 1, 1, bq, bk]
                s = jnp.where(see, s * scale, _NEG)
                # The max only stabilises the exponentials; the result does not depend on it.
                m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
                p = jnp.where(see, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                p_v = p.astype(v_j.dtype)  # the matmul's input; p's row sums stay in acc_dtype
                pv = jnp.einsum("BKGTS,BSKD->BKGTD", p_v, v_j, preferred_element_type=acc_dtype)
                return m_new, norm * corr + p.sum(-1), acc * corr[..., None] + pv

            # Key blocks wholly after the query block hold no visible key.
            return jax.lax.cond(j <= i, update, lambda c: c, carry), None

        init = (
            jnp.full((B, K, G, block), _NEG, acc_dtype),
            jnp.zeros((B, K, G, block), acc_dtype),
            jnp.zeros((B, K, G, block, D), acc_dtype),
        )
        (_, norm, acc), _ = jax.lax.scan(key_block, init, (jnp.arange(n), kb, vb, sb))
        out = acc / norm[..., None]  # every query sees itself: norm > 0
        return jnp.einsum("BKGTD->BTKGD", out).astype(q_i.dtype)

    out = jax.lax.map(query_block, (jnp.arange(n), qb, sb, pb))  # [n, B, bq, K, G, D]
    return out.swapaxes(0, 1).reshape(B, Tp, N, D)[:, :T]


def _splash_kernel(heads: int, length: int, block: int, interpret: bool, name: str | None):
    # Built at every trace: the kernel holds its mask tables as arrays of the trace.
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length))] * heads)
    sizes = splash_lib.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    return splash_lib.make_splash_mha(
        mask,
        head_shards=1,
        q_seq_shards=1,
        block_sizes=sizes,
        interpret=interpret,
        residual_checkpoint_name=name,
    )


def splash(q, k, v, segment_ids, parent_ids=None, *, block: int = 512, name: str | None = None):
    """JAX's Pallas splash-attention kernel (causal mask + segment ids, GQA) per mesh shard.

    The sequence is padded to a multiple of the block (``min(block, T)`` rounded up to 128);
    queries are pre-scaled by ``1/sqrt(D)`` (the kernel does not scale). Under a mesh the kernel
    runs inside ``jax.shard_map`` with rows split as the ``batch`` rule and heads as the
    ``heads`` / ``kv_heads`` rules say (the sequence is never split). Shared prompts run the
    kernel twice and merge the parts (:func:`_two_part_splash`).
    """
    check_block(block)
    B, T, N, D = q.shape
    K = k.shape[2]
    size = min(block, -(-T // SPLASH_BLOCK_MULTIPLE) * SPLASH_BLOCK_MULTIPLE)
    Tp = -(-T // size) * size
    q = jnp.einsum("BTND->BNTD", _pad_length(q * jnp.asarray(D**-0.5, q.dtype), Tp))
    k = jnp.einsum("BTKD->BKTD", _pad_length(k, Tp))
    v = jnp.einsum("BTKD->BKTD", _pad_length(v, Tp))
    seg = _pad_length(segment_ids.astype(jnp.int32), Tp)
    # The second part's ids: queries by the prompt they continue, keys only where a token is its
    # own parent (a prompt, a sequence of its own; padding appended as segment 0, parent 0).
    par = seg if parent_ids is None else _pad_length(parent_ids.astype(jnp.int32), Tp)
    interpret = _platform() != "tpu"

    def local(q, k, v, seg, par):
        kernel = _splash_kernel(q.shape[1], Tp, size, interpret, name)
        if parent_ids is None:
            one = lambda q, k, v, s, p: kernel(q, k, v, segment_ids=splash_lib.SegmentIds(s, s))
        else:
            one = functools.partial(_two_part_splash, kernel)
        return jax.vmap(one)(q, k, v, seg, par)

    mesh = jax.sharding.get_abstract_mesh()
    rules = spmd.get_logical_axis_rules()
    if mesh.empty:
        out = local(q, k, v, seg, par)
    else:
        q_spec = ax.logical_to_mesh((ax.BATCH, ax.HEADS, None, None), rules, mesh, q.shape)
        kv_spec = ax.logical_to_mesh((ax.BATCH, ax.KV_HEADS, None, None), rules, mesh, k.shape)
        if q_spec[1] != kv_spec[1]:
            # Key heads split differently from query heads (e.g. K not divisible by the tensor
            # axis): give every query head its own copy of its key head.
            k, v = jnp.repeat(k, N // K, axis=1), jnp.repeat(v, N // K, axis=1)
            kv_spec = q_spec
        seg_spec = PartitionSpec(q_spec[0], None)
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec),
            out_specs=q_spec,
            check_vma=False,
        )(q, k, v, seg, par)
    return jnp.einsum("BNTD->BTND", out)[:, :T]


def _two_part_splash(kernel, q, k, v, seg, par):
    """Shared-prompt attention of one row from two splash calls, merged by log-sum-exp.

    Part 1 sees each token's own segment (causal), part 2 a response's prompt: queries by
    ``par``, keys only where a token is its own parent. A prompt token (or a sequence of its
    own) sees its own segment in both parts: the merge gives its output unchanged and each part
    half of its softmax. The backward runs the kernel's own backward for each part with the
    merged output and log-sum-exp as residuals, which is exactly the gradient of the merged
    softmax (each part's keys get ``exp(s - lse) (dP - rowsum(do * out))``). It calls the
    kernel module's private forward and backward (JAX 0.10's); the interpret-mode tests
    compare it with the dense path.
    """
    ids = lambda seg, par: (
        splash_lib.SegmentIds(seg, seg),
        splash_lib.SegmentIds(par, jnp.where(par == seg, seg, -1)),
    )
    kw = kernel.kwargs
    names = ("mask_value", "is_mqa", "block_sizes", "mask_function", "attn_logits_soft_cap")
    fwd_kw = {k: kw[k] for k in (*names, "interpret")}
    fwd_kw["residual_checkpoint_name"] = None

    # The mask tables are arrays of the trace: arguments, not closed over.
    infos = (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)

    @jax.custom_vjp
    def merged(q, k, v, seg, par, infos):
        return fwd(q, k, v, seg, par, infos)[0]

    def fwd(q, k, v, seg, par, infos):
        forward = splash_lib._splash_attention_forward
        parts = [
            forward(infos[0], q, k, v, i, None, **fwd_kw, save_residuals=True)
            for i in ids(seg, par)
        ]
        (o1, (l1,)), (o2, (l2,)) = parts
        lse = jnp.logaddexp(l1, l2)
        w1, w2 = jnp.exp(l1 - lse)[..., None], jnp.exp(l2 - lse)[..., None]
        out = (w1 * o1.astype(jnp.float32) + w2 * o2.astype(jnp.float32)).astype(q.dtype)
        return out, (q, k, v, seg, par, infos, out, lse)

    def bwd(res, do):
        q, k, v, seg, par, infos, out, lse = res
        backward = splash_lib._splash_attention_bwd
        saved = lambda i: (q, k, v, i, None, out, lse, *infos[1:])
        grads = [backward(False, res=saved(i), do=do, **fwd_kw)[3:6] for i in ids(seg, par)]
        return (*(a + b for a, b in zip(*grads, strict=True)), None, None, None)

    merged.defvjp(fwd, bwd)
    return merged(q, k, v, seg, par, infos)


def slot_attention(
    q: Float[Array, "B T N D"],
    k: Float[Array, "B K D S"],
    v: Float[Array, "B K S D"],
    mask: Bool[Array, "B T S"],
) -> Float[Array, "B T N D"]:
    """Attention of queries over cache slots, each query over the slots ``mask`` marks.

    Keys are stored transposed (``[D, S]`` per head, the KV cache's layout, see
    :class:`~delta_jax.models.transformer.KVCache`).

    Both dots are written with the ``[B, K]`` batch dims leading and the query rows (T x G)
    merged, the canonical batched-matmul form: XLA:CPU then runs them as plain batched matmuls
    (an einsum with ``T`` between the batch dims made it transpose each layer's cache at every
    decode step), and for ``T = 1`` the query transposes are free bitcasts.
    """
    B, T, N, D = q.shape
    K, S = k.shape[1], v.shape[2]
    G = N // K
    batch = ((0, 1), (0, 1))
    acc_dtype = accumulation_dtype(q.dtype)
    q = jnp.swapaxes(q.reshape(B, T, K, G, D), 1, 2).reshape(B, K, T * G, D)
    scores = jax.lax.dot_general(
        q, k, (((3,), (2,)), batch), preferred_element_type=acc_dtype
    ).reshape(B, K, T, G, S)
    scores = scores * (D**-0.5)
    # A finite fill keeps rows with no visible key (padded queries) finite: uniform weights.
    scores = jnp.where(mask[:, None, :, None, :], scores, jnp.finfo(acc_dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(B, K, T * G, S)
    out = jax.lax.dot_general(probs, v, (((3,), (2,)), batch))  # [B, K, T*G, D]
    return jnp.swapaxes(out.reshape(B, K, T, G, D), 1, 2).reshape(B, T, N, D)


def cudnn(q, k, v, segment_ids, parent_ids=None):
    """``jax.nn.dot_product_attention`` with cuDNN's fused kernel (CUDA GPUs only).

    The segment mask is passed as a boolean ``[B, 1, T, T]`` mask (cuDNN has no segment ids).
    """
    if _platform() != "gpu":
        raise ValueError(
            f"model.attention='cudnn' needs a CUDA GPU (this backend: {_platform()}); use "
            "'auto', 'chunked' or 'dense' here, 'splash' on TPU"
        )
    mask = visible(segment_ids, parent_ids)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


__all__ = [
    "DENSE_MAX_LENGTH",
    "IMPLS",
    "Impl",
    "attention",
    "check_block",
    "chunked",
    "cudnn",
    "dense",
    "resolve_impl",
    "slot_attention",
    "sees",
    "splash",
    "visible",
]
