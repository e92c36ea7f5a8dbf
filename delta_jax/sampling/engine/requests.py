"""What one call of the continuous engine is, on the host: its static configuration
(:class:`EngineSpec`), a multi-turn request (:class:`Turns`), what it did (:class:`EngineStats`),
which data group runs each prompt, and the checks a request must pass before any compilation.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Literal

import numpy as np

from delta_jax.sampling.attention.pages import pages_for, pow2
from delta_jax.sampling.speculation.drafts import SOURCES

__all__ = [
    "SLOT_FIELDS",
    "STATUS_FIELDS",
    "Attention",
    "EngineRows",
    "EngineSpec",
    "EngineStats",
    "HostSlots",
    "Prompt",
    "Seq",
    "Turns",
    "assign_groups",
    "output_rows",
    "turn_stops",
    "validate_engine_request",
]

# The paged attention paths (:mod:`delta_jax.sampling.attention.paged`).
Attention = Literal["xla", "pallas", "dense"]

# Per-slot integer fields of the decode program's slot state, packed with the stop ids, the
# stop-sequence window and the page table into one [S, F] matrix: one host-to-device copy per
# chunk instead of one per field.
SLOT_FIELDS = ("last", "pos", "count", "active", "max_new", "seed", "prompt", "sample", "row")
SLOT_FIELDS += ("copy_src", "copy_dst")
# What the host reads back after a chunk, one [S, 4 + L] matrix (then the window ``recent``).
STATUS_FIELDS = ("last", "pos", "count", "active")


@dataclasses.dataclass
class HostSlots:
    """The slots' decode state on the host, one row per slot (global slot index): what a decode
    chunk is sent (:meth:`pack`) and what it reads back (:meth:`read_status`).

    Attributes:
      last, pos, count, active, max_new, seed, prompt, sample, row, copy_src, copy_dst: int32 [S],
        the fields of :data:`SLOT_FIELDS` (see ``delta_jax.sampling.engine.decode.SlotState``).
      stops: int32 [S, W], each slot's stop ids, padded with -1.
      recent: int32 [S, L], multi-turn stop sequences' window (-1: none yet).
    """

    last: np.ndarray
    pos: np.ndarray
    count: np.ndarray
    active: np.ndarray
    max_new: np.ndarray
    seed: np.ndarray
    prompt: np.ndarray
    sample: np.ndarray
    row: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    stops: np.ndarray
    recent: np.ndarray

    @classmethod
    def empty(cls, slots: int, stop_width: int, window: int) -> HostSlots:
        fields = {name: np.zeros(slots, np.int32) for name in SLOT_FIELDS}
        stops = np.full((slots, stop_width), -1, np.int32)
        return cls(**fields, stops=stops, recent=np.full((slots, window), -1, np.int32))

    def pack(self, rows: np.ndarray, table: np.ndarray) -> np.ndarray:
        """The ``rows`` slots as one int32 ``[len(rows), F]`` matrix: the fields, the stop ids,
        the window and the page table (one host-to-device copy per chunk)."""
        fields = np.stack([getattr(self, name)[rows] for name in SLOT_FIELDS], axis=1)
        return np.concatenate([fields, self.stops[rows], self.recent[rows], table], axis=1)

    def read_status(self, rows: np.ndarray, status: np.ndarray) -> None:
        """A decode chunk's ``[len(rows), 4 + L]`` status into the ``rows`` slots."""
        for i, name in enumerate(STATUS_FIELDS):
            getattr(self, name)[rows] = status[:, i]
        self.recent[rows] = status[:, len(STATUS_FIELDS) :]


@dataclasses.dataclass
class Seq:
    """Host record of one (prompt, sample) sequence."""

    prompt: int
    sample: int
    max_new: int
    stops: np.ndarray
    order: int = 0  # admission counter: the largest is the youngest
    row: int = 0  # row of its group's block of the output buffers
    pages: list[int] = dataclasses.field(default_factory=list)  # own pages
    table: list[int] = dataclasses.field(default_factory=list)  # all pages from position 0
    length: int = 0
    index: int = 0  # request row (prompt * n + sample)
    # The RNG identity it draws with (its seed's int32 bits, prompt, sample): the request's
    # seed and its own (prompt, sample), or a carried row's from the call that started it.
    rng: tuple[int, int, int] = (0, 0, 0)
    # A carried row (partial rollouts): its tokens, log-probs and untruncated log-probs so far,
    # written into its output row before the first chunk; ``unfinished``: the call stopped
    # (its quota met) before the sequence ended.
    carried: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    unfinished: bool = False
    # Multi-turn: the turns handed over, the response's tokens on the host (from the first
    # hand-over on, up to ``length`` when the sequence waits or re-joins), the observations'
    # columns, the pending observation, and the work before its next decode: tokens to prefill
    # from a position on, observation ids to write into its output row from a column on.
    turns: int = 0
    history: list[int] | None = None
    observed: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    future: concurrent.futures.Future | None = None
    due: int = 0  # partial rollouts: the decode chunk its observation is taken in before
    # (first position, ids to prefill into its pages, whether they replay a preempted context)
    resume: tuple[int, np.ndarray, bool] | None = None
    write: tuple[int, np.ndarray] | None = None


@dataclasses.dataclass
class Prompt:
    ids: np.ndarray
    group: int = 0  # the data group whose pool holds the prompt's pages and runs its samples
    pages: list[int] | None = None  # resident pages of the prefix (all but the last token)
    running: int = 0
    left: int = 0  # samples not finished yet

    @property
    def prefix(self) -> int:
        return self.ids.size - 1


@dataclasses.dataclass(frozen=True)
class Turns:
    """A multi-turn request: where a turn ends, and how the host answers it.

    A sequence that draws one of ``stop_ids``, or whose ids drawn in the current turn end with
    one of ``stop_sequences`` (an environment's stop strings, tokenized; ids of the prompt or
    of an observation never count toward a match), has ended a *turn*, not its episode (unless
    it was its ``max_turns``-th turn, or its token budget is spent): the engine reads the turn's
    tokens, calls ``submit(row, turn)`` (``row``: the request row ``prompt * n + sample``;
    ``turn``: its ids since the last observation, the stop id or sequence included) and gives
    the slot to another sequence while the host works. The sequence keeps its KV pages. The
    future's result is the observation's ids: they are written into the sequence's output row
    (as context, never sampled) and prefilled into its own pages, and the sequence re-joins a
    free slot for its next turn; the history is never prefilled again. ``None`` ends the
    episode, as does an observation that leaves no room in the budget (observation tokens count
    against ``max_new_tokens``) for one more token.

    Token ``t`` of a sequence is still drawn with the key of its column ``t``, so the tokens do
    not depend on the slot count, on how long the host takes or on preemptions. Stop sequences
    are matched on device, at the step that draws their last id (a window of the turn's last
    ids per slot, see :func:`~delta_jax.sampling.engine.chunk.decode_chunk`); a one-id sequence is
    a stop id.
    """

    stop_ids: tuple[int, ...]
    max_turns: int
    submit: Callable[[int, list[int]], concurrent.futures.Future]
    stop_sequences: tuple[tuple[int, ...], ...] = ()


def turn_stops(turns: Turns | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The ids that end a turn (``stop_ids`` and the one-id sequences) and the longer stop
    sequences as an int32 ``[Q, L]`` matrix, right-aligned and left-padded with -1 (None when
    there are none: the decode program then has no window)."""
    if turns is None:
        return np.zeros(0, np.int32), None
    seqs = [tuple(q) for q in turns.stop_sequences]
    ids = list(turns.stop_ids) + [q[0] for q in seqs if len(q) == 1]
    longer = [q for q in seqs if len(q) > 1]
    if not longer:
        return np.asarray(ids, np.int32), None
    L = max(map(len, longer))
    patterns = np.full((len(longer), L), -1, np.int32)
    for i, q in enumerate(longer):
        patterns[i, L - len(q) :] = q
    return np.asarray(ids, np.int32), patterns


@dataclasses.dataclass
class EngineStats:
    """What one engine call did (for tests and benchmarks); page figures are per data group."""

    decode_steps: int = 0  # slot-steps run: chunks x steps x slots (every group's)
    useful_steps: int = 0  # generated tokens
    chunks: int = 0
    prefill_calls: int = 0
    preemptions: int = 0
    handovers: int = 0  # turns handed to the host (multi-turn)
    observation_tokens: int = 0  # observation ids appended to sequences
    resumed_tokens: int = 0  # ids prefilled into sequences' own pages (observations, and the
    # context of multi-turn sequences preempted after a hand-over)
    replayed_tokens: int = 0  # of those, the contexts prefilled again after such a preemption
    wait_s: float = 0.0  # host time blocked on observations (no slot able to run, or due)
    waiting_pages_peak: tuple[int, ...] = ()  # per group: most pages held by waiting sequences
    high_water_pages: tuple[int, ...] = ()  # per group: the most pages in use at once
    free_pages_after: tuple[int, ...] = ()  # per group: free pages after the call
    group_pages: int = 0  # pages in one group's share of the pool (its scratch page included)
    # Speculative decoding: live slots' verify steps, and drafted and accepted tokens by draft
    # source (``delta_jax.sampling.speculation.drafts.SOURCES``).
    verify_steps: int = 0
    drafted: dict[str, int] = dataclasses.field(default_factory=dict)
    accepted: dict[str, int] = dataclasses.field(default_factory=dict)
    # Whether the request speculated (None: its sampler has no drafts, ``draft_tokens = 0``).
    speculative: bool | None = None
    unfinished: int = 0  # rows returned before they ended (a quota met, partial rollouts)

    @property
    def occupancy(self) -> float:
        """Fraction of slot-steps that produced a token."""
        return self.useful_steps / max(1, self.decode_steps)

    @property
    def tokens_per_verify_step(self) -> float:
        """Tokens a live slot emitted per verify step (1 without speculation)."""
        return self.useful_steps / self.verify_steps if self.verify_steps else 1.0

    def add_verify(self, counts: np.ndarray) -> None:
        """A speculative chunk's per-slot counters ``[S, 1 + 2 * sources]`` (verify steps, then
        drafted and accepted tokens by source): the chunk ran as many steps as its busiest
        slot."""
        n = len(SOURCES)
        self.decode_steps += int(counts[:, 0].max(initial=0)) * len(counts)
        self.verify_steps += int(counts[:, 0].sum())
        for i, source in enumerate(SOURCES):
            self.drafted[source] = self.drafted.get(source, 0) + int(counts[:, 1 + i].sum())
            self.accepted[source] = self.accepted.get(source, 0) + int(counts[:, 1 + n + i].sum())


@dataclasses.dataclass(frozen=True)
class EngineRows:
    """The rows of one engine call: ``n`` samples of each of ``prompts`` (int32 arrays), each
    row's token budget ``max_new`` and stop ids ``stop_ids [R, W]`` (padded with -1), the
    request's ``seed`` (uint32), and for partial rollouts the rows ``carried`` from an earlier
    call (per row: None, or a :class:`~delta_jax.sampling.output.Carry`)."""

    prompts: list[np.ndarray]
    n: int
    max_new: np.ndarray
    stop_ids: np.ndarray
    seed: int = 0
    carried: tuple | None = None


@dataclasses.dataclass
class EngineSpec:
    """Static configuration of one engine call (what the compiled programs depend on).

    ``slots`` and ``num_pages`` count the whole mesh; both split evenly over the ``groups`` data
    groups (the sampling mesh's row shards), each group owning a contiguous block of slots and
    of pool pages (its own scratch page first).
    """

    slots: int
    steps: int
    page_size: int
    num_pages: int
    seq_pages: int  # pages of the longest sequence (prompt bucket + generation bucket)
    max_table: int  # page-table width cap (``seq_pages`` up to a power of two)
    prefill_len: int  # longest prefill chunk
    min_len: int  # floor of the prefill-chunk and page-table (in tokens) buckets
    prefill_rows: int  # prompts per prefill call, every group's (fixed: no recompilation)
    groups: int  # data groups: independent slot sets and page pools
    attention: Attention
    return_hidden: bool
    pad_id: int
    # Speculative decoding: tokens drafted per slot and verify step (0: plain decode steps),
    # the depth of a trie of them (0: one line), and each slot's draft window per chunk.
    draft_tokens: int = 0
    draft_depth: int = 0
    draft_window: int = 0

    @property
    def group_slots(self) -> int:
        return self.slots // self.groups

    @property
    def group_pages(self) -> int:
        return self.num_pages // self.groups

    def chunk_slots(self, occupied: int) -> int:
        """Slots per group of a decode chunk whose fullest group runs ``occupied`` sequences:
        a power of two from an eighth of a group's slots up to all of them."""
        S = self.group_slots
        return min(S, max(-(-S // 8), pow2(occupied)))

    def prefill_length(self, longest: int) -> int:
        """Tokens per row of a prefill call whose longest job has ``longest`` tokens."""
        return min(self.prefill_len, max(self.min_len, pow2(longest)))


def assign_groups(prompts: list[np.ndarray], n: int, max_new: np.ndarray, groups: int):
    """The data group of each prompt (all its ``n`` samples run there, sharing its pages).

    Longest-processing-time first: prompts by decreasing work (their samples' token budgets
    plus the prompt's own tokens), each to the group with the least work so far. A function of
    the request only, so every process of a multi-host run assigns the same.
    """
    work = [len(p) + int(max_new[i * n : (i + 1) * n].sum()) for i, p in enumerate(prompts)]
    load = [0] * groups
    owner = [0] * len(prompts)
    for i in sorted(range(len(prompts)), key=lambda i: (-work[i], i)):
        g = min(range(groups), key=lambda g: (load[g], g))
        owner[i] = g
        load[g] += work[i]
    return owner


def output_rows(owner: list[int], n: int, groups: int) -> tuple[np.ndarray, int]:
    """Each request row's row in its data group's block of the output buffers, and the rows of
    one block (the most rows any group runs); with one group, row ``r`` is row ``r``."""
    rows = np.zeros(len(owner) * n, np.int64)
    used = [0] * groups
    for r in range(len(owner) * n):
        g = owner[r // n]
        rows[r] = used[g]
        used[g] += 1
    return rows, max(used)


def validate_engine_request(
    spec: EngineSpec, prompts: list[np.ndarray], n: int, max_new: np.ndarray
) -> None:
    """Raises ``ValueError`` for requests the engine cannot run, before any compilation (what
    the attention path itself refuses: ``PagedBackend.refusal``)."""
    G, Sg = spec.groups, spec.group_slots
    if n > Sg:
        where = (
            f"decode_slots={spec.slots}"
            if G == 1
            else f"the {Sg} decode slots of one data group (decode_slots={spec.slots} is the "
            f"total over {G} data groups; a prompt's samples run in one group, sharing its pages)"
        )
        raise ValueError(f"n={n} samples per prompt exceeds {where}; raise decode_slots or lower n")
    ps, usable = spec.page_size, spec.group_pages - 1
    share = "" if G == 1 else f" (one data group's share of {spec.num_pages} pages over {G})"
    for r, budget in enumerate(max_new[: len(prompts) * n]):
        prefix = prompts[r // n].size - 1
        # The prompt's pages plus the sequence's own ones (from the partial last page on).
        need = pages_for(prefix, ps) + pages_for(prefix + int(budget), ps) - prefix // ps
        if need > usable:
            raise ValueError(
                f"the page pool{share} ({usable} usable pages of {ps} tokens) is too small for "
                f"one sequence: prompt {r // n} with max_new_tokens {budget} needs {need} pages"
            )
    longest = max(p.size for p in prompts) + int(max_new.max())
    if pages_for(longest, ps) > spec.max_table:
        raise ValueError(f"a sequence of {longest} tokens exceeds the page-table width")
