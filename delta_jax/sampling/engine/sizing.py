"""The continuous engine's size for a request: slots, page pool, page tables and prefill rows.

One pure function of the sampler's engine settings and the request's shape
(:func:`size_engine`): the :class:`~delta_jax.sampling.Sampler` sizes each call with it, and the
planner (:mod:`delta_jax.plan`) sizes the rollout it compiles with the same function, without a
model or a sampler.
"""

from __future__ import annotations

import dataclasses

from delta_jax.sampling.attention import pages_for
from delta_jax.sampling.buckets import RequestArrays
from delta_jax.sampling.engine.requests import Attention, EngineSpec

__all__ = ["EngineSettings", "RequestShape", "size_engine"]


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """A sampler's continuous-engine settings (the :class:`~delta_jax.sampling.Sampler`
    arguments of the same names, which document them), with the attention path resolved for
    its platform and ``groups``, the data groups of its mesh (its row shards; 1 without a
    mesh)."""

    attention: Attention
    groups: int = 1
    decode_slots: int = 32
    page_size: int = 16
    num_pages: int | None = None
    decode_chunk: int = 16
    prefill_chunk: int = 512
    min_length: int = 16  # the buckets' floor (``Buckets.min_length``)
    pad_id: int = 0


@dataclasses.dataclass(frozen=True)
class RequestShape:
    """What sizing reads of a request: its prompts, samples per prompt, prompt bucket and the
    largest token budget."""

    prompts: int
    n: int
    prompt_len: int
    budget: int

    @classmethod
    def of(cls, request: RequestArrays, n: int) -> RequestShape:
        return cls(
            request.num_rows // n, n, request.prompt_ids.shape[1], int(request.max_new.max())
        )


def size_engine(
    settings: EngineSettings,
    request: RequestShape,
    *,
    return_hidden: bool,
    multi_turn: bool = False,
    draft_tokens: int = 0,
    draft_depth: int = 0,
    draft_window: int = 0,
) -> EngineSpec:
    """The engine's static configuration for ``request`` (``multi_turn``: the default pool also
    holds the pages of sequences waiting on the host; ``draft_tokens`` > 0: verify steps of that
    many drafted tokens, a trie ``draft_depth`` deep, windows of ``draft_window`` tokens)."""
    s, groups, ps = settings, settings.groups, settings.page_size
    # No idle slots: a group never runs more sequences than the request's rows it can hold
    # (its prompts, spread evenly, times n).
    n, prompts = request.n, request.prompts
    group_slots = min(-(-s.decode_slots // groups), -(-prompts // groups) * n)
    # The longest sequence: the prompt bucket plus the largest token budget (not the
    # generation bucket, which rounds it up: the pool holds real positions only).
    longest = pages_for(request.prompt_len + request.budget, ps)
    if s.num_pages:
        group_pages = -(-s.num_pages // groups)
    else:
        # What running sequences really hold: a resident prompt's pages (all but its last
        # token, shared by its samples; at most one resident prompt per running slot, idle
        # ones are freed first) and each sequence's own pages (from the prompt's partial
        # last page on, wherever the prompt ends in a page). The default never preempts.
        prompt_pages = pages_for(request.prompt_len - 1, ps)
        own_pages = pages_for(request.budget + ps - 1, ps)
        resident, holders = min(group_slots, prompts), group_slots
        if multi_turn:  # every sequence of the group may hold pages while it waits
            resident = -(-prompts // groups)
            holders = resident * n
        group_pages = holders * own_pages + resident * prompt_pages + 1
    # A new prompt needs a free slot: about slots / n prompts join a group at a time.
    at_once = 1 << (-(-group_slots // n) - 1).bit_length()
    return EngineSpec(
        slots=groups * group_slots,
        steps=s.decode_chunk,
        page_size=ps,
        num_pages=groups * group_pages,
        seq_pages=longest,
        max_table=1 << (longest - 1).bit_length(),
        prefill_len=s.prefill_chunk,
        min_len=s.min_length,
        prefill_rows=groups * at_once,
        groups=groups,
        attention=s.attention,
        return_hidden=return_hidden,
        pad_id=s.pad_id,
        draft_tokens=draft_tokens,
        draft_depth=draft_depth if draft_tokens else 0,
        draft_window=draft_window if draft_tokens else 0,
    )
