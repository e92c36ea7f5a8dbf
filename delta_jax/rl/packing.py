"""Rows for the update: rollout sequences packed first-fit-decreasing, or one padded per row.

The rollout keeps every sequence on device in the padded layout ``prompt (left-padded to P) ++
response (right-padded to G)``. The update reads rows of ``T`` input positions. A
:class:`Layout` (host int32 index arrays, built from the sequence lengths alone) says where each
position comes from; :func:`assemble` gathers the :class:`~delta_jax.rl.train_step.TrainBatch` of
every mini-batch from the device arrays in one jitted program, so no token or log-prob crosses to
the host.

Every token of a sequence is an input; the loss is on the positions whose target is a response
token the policy drew (``loss_mask``), and only there does a position carry an advantage, a
sampler log-prob or a coefficient. In a multi-turn rollout the observation tokens that an
environment wrote into the response (False in ``action_mask``) are context: attention reads
them, the loss does not.

Packing (``algo.packing``): a sequence of prompt ``p`` and response ``g`` tokens fills
``p + g - 1`` positions (its last token predicts nothing); the sequences of a mini-batch go into
rows of ``tokens_per_row`` positions, longest first, each into the first row with room
(first-fit-decreasing), numbered 1, 2, ... in its row (``segment_ids``). Responses of no tokens
carry no loss and are left out. The LM head then runs only on the positions that predict a
response token: each packed row lists them (``Layout.score``) first in a window of as many
slots as the row has positions, empty slots last, and on CPU the LM head skips the chunks of
slots that no row uses (:func:`delta_jax.models.logprobs.slot_logprobs`). The padded layout's window
is the row's last ``W`` positions, as the prompt ends at the same place in every row.

Packed rows fill micro-batches of ``algo.micro_batch_rows`` rows in order, as many as the
step's rows need (the train step and the passes before it skip the empty ones): one update
program per run, whatever the lengths do to the rows or the window (:func:`micro_batch_shape`).
A micro-batch holds at most the padded layout's rows / ``algo.micro_batches`` (a token budget,
so its memory is as configured). ``bucketed``: a step's rows in one micro-batch, its rows
bucketed: one update program per bucket a run meets (:func:`row_buckets`).

Shared prompts (``algo.share_prompts``, packed rows; ``auto``: in the steps where it takes
fewer rows, :attr:`UpdatePlan.share_if_fewer_rows`): the responses of one prompt go into a row
as one *chunk*: the prompt's ``p`` tokens once, then each response's ``g - 1`` (as many as fit
a row; a larger group is several chunks, each with the prompt). The prompt is a segment, each
response a segment whose ``parent_ids`` name the prompt's (it sees the prompt and its own
earlier tokens, :mod:`delta_jax.models.attention`), at positions continuing from the prompt's
end. The prompt's last position predicts the first token of every response: it fills one slot
per response, each with that response's target (``Layout.score_source`` / ``score_column``).
Every response token sees what it sees in a row of its own, at the same position, so the
log-probs, hidden states and gradients are the unshared update's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.rl.train_step import TrainBatch
from delta_jax.rl.update_plan import UpdatePlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each input position of some rows comes from (int32 ``[..., rows, T]``), and in
    packed rows what each scored slot predicts (int32 ``[..., rows, W]``)."""

    source: np.ndarray  # rollout sequence of the position (0 on padding)
    column: np.ndarray  # its column in the padded sequence prompt (P) ++ response (G)
    segment_ids: np.ndarray  # 1, 2, ... per sequence (or shared prompt) in the row; 0 = padding
    score: np.ndarray | None = None  # packed: [..., rows, W] positions predicting a response
    # token, in order; -1 = an empty slot. None: the padded layout's last W positions.
    score_source: np.ndarray | None = None  # packed: the sequence whose token a slot predicts
    score_column: np.ndarray | None = None  # ... the column of its input (target: the next)
    score_segment: np.ndarray | None = None  # ... the segment of that sequence's response
    positions: np.ndarray | None = None  # shared prompts: the rotary position of each input
    parent_ids: np.ndarray | None = None  # ... the segment of the prompt it continues


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each of total length <= ``capacity`` (longest items first)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > capacity:
            raise ValueError(f"sequence of {lengths[i]} positions > row of {capacity}")
        slot = next((b for b, r in enumerate(room) if r >= lengths[i]), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= lengths[i]
    return bins


def bucket_rows(rows: int, unit: int, limit: int) -> int:
    """The smallest ``unit`` x {1, 2, 3, 4, 6, 8, 12, ...} covering ``rows``, at most ``limit``.

    Two buckets per power of two: at most ``2 log2(limit / unit) + 1`` programs, and at most a
    third of the rows padding.
    """
    units = -(-max(rows, 1) // unit)
    power = 1 << (units - 1).bit_length()  # smallest power of two >= units
    size = 3 * power // 4 if power >= 4 and units <= 3 * power // 4 else power
    return min(unit * size, limit)


Chunk = tuple[int, ...]  # sequences laid out together: one, or several sharing their prompt


def chunks(plan: UpdatePlan, seqs: np.ndarray, prompt_lens, resp_lens, share: bool) -> list[Chunk]:
    """The chunks of one mini-batch's sequences (in order): each sequence alone, or when
    ``share`` the responses of each prompt (``plan.group_size`` consecutive sequences) in chunks
    that fit a row, longest first."""
    kept = [int(s) for s in seqs if resp_lens[s] > 0 or not plan.packing]
    if not share:
        return [(s,) for s in kept]
    groups: dict[int, list[int]] = {}
    for s in kept:
        groups.setdefault(s // plan.group_size, []).append(s)
    out = []
    for group in groups.values():
        if len({int(prompt_lens[s]) for s in group}) > 1:
            raise ValueError(f"sequences {group} share a prompt but not its length")
        group.sort(key=lambda s: (-int(resp_lens[s]), s))
        chunk, size = [], int(prompt_lens[group[0]])
        for s in group:
            if chunk and size + int(resp_lens[s]) - 1 > plan.row_len:
                out.append(tuple(chunk))
                chunk, size = [], int(prompt_lens[s])
            chunk.append(s)
            size += int(resp_lens[s]) - 1
        out.append(tuple(chunk))
    return out


def chunk_span(chunk: Chunk, prompt_lens, resp_lens) -> int:
    """Positions a chunk fills: its prompt once, each response's tokens but its last."""
    return int(prompt_lens[chunk[0]]) + sum(int(resp_lens[s]) - 1 for s in chunk)


def row_groups(
    plan: UpdatePlan, seqs: np.ndarray, prompt_lens, resp_lens, share: bool
) -> list[list[Chunk]]:
    """Chunks of each row of one mini-batch (``seqs``: its rollout sequences, in order)."""
    found = chunks(plan, seqs, prompt_lens, resp_lens, share)
    if not plan.packing:
        return [[c] for c in found]
    spans = [chunk_span(c, prompt_lens, resp_lens) for c in found]
    return [[found[i] for i in row] for row in first_fit_decreasing(spans, plan.row_len)]


def layout(
    plan: UpdatePlan, groups: list[list[Chunk]], rows: int, prompt_lens, resp_lens, width: int = 0
) -> Layout:
    """Index arrays ``[rows, T]`` of rows holding ``groups`` of chunks (padding rows after
    them); packed rows also list what their ``width`` slots predict."""
    P, T = plan.prompt_len, plan.row_len
    ints = lambda n, fill=0: np.full((rows, n), fill, np.int32)
    source, column, segment_ids, positions, parent_ids = (ints(T) for _ in range(5))
    score = ints(width, -1)
    score_source, score_column, score_segment = (ints(width) for _ in range(3))
    for r, row in enumerate(groups):

        def place(at, s, first, n, seg, prompt, pos, r=r):
            cut = slice(at, at + n)
            source[r, cut], segment_ids[r, cut], parent_ids[r, cut] = s, seg, prompt
            column[r, cut], positions[r, cut] = first + np.arange(n), pos + np.arange(n)

        # The padded layout keeps each sequence where it is (prompt ending at P); packed rows
        # place the chunks one after another from position 0.
        at, seg, k = 0, 0, 0
        for chunk in row:
            p = int(prompt_lens[chunk[0]])
            at = at if plan.packing else P - p
            prompt = seg = seg + 1
            # The prompt's last token is an input when it predicts a response token (padded
            # rows keep sequences whose response is empty: their prompt but its last token).
            place(at, chunk[0], P - p, p - (int(resp_lens[chunk[0]]) == 0), seg, prompt, 0)
            last, at = at + p - 1, at + p
            for s in chunk:
                # A chunk of one is one segment; shared, each response is a segment of its own.
                seg += len(chunk) > 1
                n = max(int(resp_lens[s]) - 1, 0)
                place(at, s, P, n, seg, prompt, p)
                if plan.packing:  # its first token from the prompt's last position, then its own
                    slots = slice(k, k + n + 1)
                    score[r, slots] = [last, *range(at, at + n)]
                    score_source[r, slots], score_segment[r, slots] = s, seg
                    score_column[r, slots] = P - 1 + np.arange(n + 1)
                    k += n + 1
                at += n
    packed = (score, score_source, score_column, score_segment) if plan.packing else [None] * 4
    shared = (positions, parent_ids) if plan.share_prompts else (None, None)
    return Layout(source, column, segment_ids, *packed, *shared)


def micro_batch_shape(plan: UpdatePlan, rows: int, shards: int) -> tuple[int, int]:
    """``(micro-batches, rows per micro-batch)`` holding ``rows`` packed rows; rows fill the
    micro-batches in order and the train step skips those left empty. Each holds at most the
    padded layout's rows (``rows_per_update / micro_batches`` rows of ``tokens_per_row``, so
    its memory is bounded as configured).

    One shape per run (``plan.micro_batch_rows``): micro-batches of that many rows (a multiple
    of ``shards``), as many as the most rows a step can lay out (one sequence per row) need.
    Bucketed (0): the plan's micro-batches, and when the rows fit in one, its rows bucketed
    (:func:`bucket_rows`, a multiple of ``shards``).
    """
    budget = plan.rows_per_update // plan.micro_batches
    if plan.packing and plan.micro_batch_rows:
        size = min(-(-plan.micro_batch_rows // shards) * shards, budget)
        return -(-plan.rows_per_update // size), size
    if not plan.packing or rows > budget:
        return plan.micro_batches, budget
    return plan.micro_batches, bucket_rows(rows, shards, limit=budget)


def row_buckets(plan: UpdatePlan, shards: int) -> list[int]:
    """Every rows-per-micro-batch a step of ``plan`` can lay out (one row up to one sequence per
    row): one update program each, the set a run can compile whatever its lengths."""
    most = plan.rows_per_update
    return sorted({micro_batch_shape(plan, r, shards)[1] for r in range(1, most + 1)})


def plan_rows(
    plan: UpdatePlan, order: np.ndarray, prompt_lens, resp_lens, shards: int
) -> tuple[Layout, dict[str, float]]:
    """The layout of every mini-batch ``[mini, M, b, T]`` and its padding statistics.

    Args:
      plan: the update plan.
      order: rollout sequences in update order (mini-batch ``m`` takes the ``m``-th block).
      prompt_lens, resp_lens: tokens per sequence.
      shards: the batch shards; rows per micro-batch are a multiple of it.
    """
    per = plan.rows_per_update
    blocks = [order[m * per : (m + 1) * per] for m in range(plan.mini_batches)]

    def rows_of(share: bool):
        groups = [row_groups(plan, b, prompt_lens, resp_lens, share) for b in blocks]
        return share, groups, max(map(len, groups))

    # auto: a step shares its prompts only where that takes fewer rows (ties: not shared, whose
    # fullest row holds fewer responses, so fewer of the LM head's slots).
    options = (False, True) if plan.share_if_fewer_rows else (plan.share_prompts,)
    shared, groups, most = min(map(rows_of, options), key=lambda o: o[2])
    micro, rows = micro_batch_shape(plan, most, shards)
    responses = lambda row: sum(int(resp_lens[s]) for chunk in row for s in chunk)
    fullest = max(responses(row) for g in groups for row in g or [[]])
    width = plan.window if plan.packing else 0
    parts = [layout(plan, g, micro * rows, prompt_lens, resp_lens, width) for g in groups]
    out = jax.tree.map(lambda *x: np.stack(x).reshape(plan.mini_batches, micro, rows, -1), *parts)
    used = -(-most // rows)  # micro-batches run (the rest hold padding only: skipped)
    real = float((out.segment_ids > 0).sum())
    stats = {
        "batch/packed_rows": used * rows,
        "batch/micro_batches": used,
        "batch/pad_fraction": 1.0 - real / (plan.mini_batches * used * rows * plan.row_len),
        "batch/positions": real,
        "batch/shared_prompts": float(shared),
        # The LM head's slots: each row's up to the fullest row's (to a chunk of slots).
        "batch/scored_positions": used * rows * (fullest if plan.packing else plan.window),
    }
    return out, stats


def uniform_rows(plan: UpdatePlan, prompt_len: int, response_len: int, shards: int) -> dict:
    """:func:`plan_rows`' statistics for a rollout batch of prompts of ``prompt_len`` tokens and
    responses of ``response_len``: the rows and positions such a step's update runs (the
    planner's estimate at a workload's mean lengths)."""
    n = plan.rows
    lens = lambda x: np.full(n, x, np.int32)
    return plan_rows(plan, np.arange(n), lens(prompt_len), lens(response_len), shards)[1]


def make_assemble(plan: UpdatePlan, out_sharding=None):
    """The jitted :func:`assemble` of ``plan``; every output field placed by ``out_sharding``."""
    return jax.jit(functools.partial(assemble, plan=plan, out_sharding=out_sharding))


def assemble(
    sequences: jax.Array,
    rollout_logprobs: jax.Array,
    advantages: jax.Array,
    coefficients: jax.Array | None,
    action_mask: jax.Array | None,
    index: Layout,
    *,
    plan: UpdatePlan,
    out_sharding=None,
) -> TrainBatch:
    """Gathers the stacked batch ``[mini, M, b, ...]`` of ``index`` from the rollout arrays.

    Args:
      sequences: int32 ``[B, P + G]`` padded sequences.
      rollout_logprobs: f32 ``[B, G]`` the sampler's log-probs of the response tokens.
      advantages: f32 ``[B]``.
      coefficients: f32 ``[B, G]`` DelTA coefficients from the sampler's hidden states, or None.
      action_mask: bool ``[B, G]`` True where the policy drew the response token (multi-turn),
        or None: every response token is an action.
      index: the :class:`Layout` (device int32 arrays).
      plan: the update plan.
      out_sharding: sharding of every output field (rows on axis 2), or None.
    """
    P, G, w = plan.prompt_len, plan.gen_len, plan.score_from
    src, col, seg = index.source, index.column, index.segment_ids
    put = (
        (lambda x: x)
        if out_sharding is None
        else functools.partial(jax.lax.with_sharding_constraint, shardings=out_sharding)
    )
    tokens = sequences[src, col]
    if index.score is None:  # padded: the window is each row's last W positions
        slot, src, col_w, seg_w = True, src[..., w:], col[..., w:], seg[..., w:]
        targets = jnp.where(seg > 0, sequences[index.source, jnp.minimum(col + 1, P + G - 1)], 0)
    else:  # packed: what the layout's slots predict; -1 is an empty slot
        slot = index.score >= 0
        src, col_w = index.score_source, index.score_column
        seg_w = jnp.where(slot, index.score_segment, 0)
        targets = jnp.where(slot, sequences[src, jnp.minimum(col_w + 1, P + G - 1)], 0)
    t = col_w + 1 - P
    at_target = lambda x: x[src, jnp.clip(t, 0, G - 1)]  # x [B, G] at the target's column
    # The target is one of the sequence's response tokens, and the policy drew it.
    loss_mask = slot & (seg_w > 0) & (t >= 0)
    if action_mask is not None:
        loss_mask = loss_mask & at_target(action_mask)
    per_token = lambda x: jnp.where(loss_mask, at_target(x), 0)
    maybe = lambda x: None if x is None else put(x)
    return TrainBatch(
        tokens=put(jnp.where(seg > 0, tokens, 0)),
        targets=put(targets),
        segment_ids=put(seg),
        loss_mask=put(loss_mask),
        advantages=put(jnp.where(loss_mask, advantages[src], 0.0)),
        rollout_logprobs=put(per_token(rollout_logprobs)),
        coefficients=None if coefficients is None else put(per_token(coefficients)),
        score_positions=maybe(index.score),
        score_segments=None if index.score is None else put(seg_w),
        positions=maybe(index.positions),
        parent_ids=maybe(index.parent_ids),
    )
