"""Drafts without a draft model: the tokens that followed a sequence's last few tokens elsewhere
in text the rollout already has (host-side, NumPy and dicts).

Speculative rollouts verify several drafted tokens per weight read. RL rollouts have three
cheap sources of good drafts, looked up in this order:

* ``self``: the sequence's own prompt and text (restated numbers, repeated expressions);
* ``siblings``: the other samples of the same prompt in this request, which share most of their
  text (the overlap DelTA is about);
* ``history``: earlier requests' rollouts of the same prompt (a prompt comes back every epoch),
  a bounded number of texts per prompt and of prompts.

A draft is the continuation of an earlier occurrence of the sequence's last ``n``
tokens, the longest ``n`` first (``max_ngram`` down to ``min_ngram``) and, at each ``n``, the
sources in the order above. Each lookup is one dict probe per source and ``n``: every source
keeps, per ``n``, where the first few occurrences of each n-gram were followed (the earliest:
the most text after them; for ``history``, the latest ones, newest first), updated as tokens
arrive. A decode chunk's window holds the continuations of several of these occurrences, then
the whole texts themselves, so the device can draft afresh at every verify step
(:mod:`delta_jax.sampling.speculation.speculate`).

A draft changes only how fast tokens come, never which: the engine accepts a drafted token
exactly when it equals the token it draws at that index with the sequence's own key, as it
would without speculation.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["MAX_NGRAM", "SOURCES", "Draft", "Drafter", "Drafts"]

SOURCES = ("self", "siblings", "history")
MAX_NGRAM = 4  # the longest suffix matched by default: a window's tail width on device


@dataclasses.dataclass(frozen=True)
class Draft:
    """Up to ``k`` proposed next tokens of a sequence and the source they came from (one of
    :data:`SOURCES`; None with no tokens)."""

    tokens: np.ndarray  # int32 [<= k]
    source: str | None


_NONE = Draft(np.zeros(0, np.int32), None)


class Drafts(NamedTuple):
    """A speculative decode chunk's drafts, one row per slot (NumPy on the host; the device
    programs take the same tuple of arrays, :mod:`delta_jax.sampling.speculation.speculate`).

    Attributes:
      window: int32 ``[S, D]``, the text the slot's sequence may go on with
        (:meth:`Drafter.window`; -1 pads).
      sources: int32 ``[S, D]``, each window token's source (its index in :data:`SOURCES`;
        -1 for pads).
      tail: int32 ``[S, max_ngram]``, the sequence's last tokens (:meth:`Drafter.last`).
    """

    window: np.ndarray
    sources: np.ndarray
    tail: np.ndarray


class _Ngrams:
    """Where the first (``first``) or the latest ``keep`` occurrences of every n-gram (``n`` in
    ``[lo, hi]``) of some token documents were followed: ``(document, index of the next
    token)``, the first or the latest first."""

    def __init__(self, lo: int, hi: int, keep: int, first: bool = True):
        self.sizes = range(hi, lo - 1, -1)  # longest first
        self.tables: dict[int, dict[tuple[int, ...], list[tuple[int, int]]]] = {
            n: {} for n in self.sizes
        }
        self.keep, self.first = keep, first

    def add(self, doc: int, tokens: list[int], start: int, old: int) -> None:
        """Records the n-grams of ``tokens`` (document ``doc``, now this long) followed by a
        token at an index in ``[max(start, old), len(tokens))``: ``old`` is the length the
        document had at the last call, ``start`` the first index this table covers."""
        for i in range(max(start, old), len(tokens)):
            for n in self.sizes:
                if i >= n:
                    seen = self.tables[n].setdefault(tuple(tokens[i - n : i]), [])
                    if not self.first:
                        seen.insert(0, (doc, i))
                        del seen[self.keep :]
                    elif len(seen) < self.keep:
                        seen.append((doc, i))

    def find(self, n: int, key: tuple[int, ...]) -> list[tuple[int, int]]:
        return self.tables[n].get(key, [])


class _History:
    """Earlier requests' texts (prompt included) of one prompt, the latest ``keep`` of them, and
    their responses' n-grams (the prompt's own are the ``self`` source)."""

    def __init__(self, prompt_len: int, lo: int, hi: int, keep: int, pieces: int):
        self.prompt_len, self.lo, self.hi, self.keep, self.pieces = prompt_len, lo, hi, keep, pieces
        self.texts: list[list[int]] = []
        self.ngrams = self._index()

    def _index(self) -> _Ngrams:
        return _Ngrams(self.lo, self.hi, self.pieces, first=False)  # the newest texts' first

    def add(self, texts: Sequence[list[int]]) -> None:
        self.texts.extend(texts)
        new = range(len(self.texts) - len(texts), len(self.texts))
        if len(self.texts) > self.keep:  # the oldest go, and their n-grams: index anew
            self.texts = self.texts[-self.keep :]
            self.ngrams, new = self._index(), range(len(self.texts))
        for doc in new:
            self.ngrams.add(doc, self.texts[doc], self.prompt_len, 0)


class Drafter:
    """Drafts for the sequences of one request at a time, and the history kept across requests.

    A request's rows are ``prompt * n + sample``, as in the engine. Call :meth:`begin` with the
    request's prompts, :meth:`extend` with each row's new tokens (sampled ones and, multi-turn,
    observations) as they arrive, :meth:`propose` for a row's next draft, and :meth:`finish`
    at the request's end (its texts join the history).

    Args:
      k: most tokens per draft, ``>= 1``.
      min_ngram, max_ngram: the suffix lengths matched, ``1 <= min_ngram <= max_ngram``. A
        verify step scores ``k + 1`` positions whatever it drafts, so a draft from a match of one
        token costs nothing more than none: on SmolLM2's step-by-step answers (chain_sum, 8
        samples a prompt, 4-step chunks) 1 instead of 2 raised the tokens per verify step from
        1.25 to 1.41 (``benchmarks/speculative.py``).
      history_texts: earlier texts kept per prompt (0: no ``history`` source).
      history_prompts: prompts with a history, the least recently requested dropped first.
      pieces: most continuations in a decode chunk's window (and occurrences kept per n-gram
        and source); on SmolLM2's step-by-step answers (8 samples a prompt, 16-step chunks)
        a window of 8 looked up at every verify step gave 1.42 tokens per verify step where
        one continuation per source followed through the chunk gave 1.33, 1.59 with the
        whole texts after the 8, and 1.64 with the device's vote among the occurrences
        (``benchmarks/speculative.py``).

    Examples:
      >>> d = Drafter(k=3, min_ngram=1, max_ngram=2)
      >>> d.begin([np.array([5, 6])], n=2)
      >>> d.extend(0, [7, 8, 9, 10])
      >>> d.extend(1, [7])  # the sibling's text after "7": "8 9 10"
      >>> draft = d.propose(1)
      >>> draft.tokens.tolist(), draft.source
      ([8, 9, 10], 'siblings')
    """

    def __init__(
        self,
        k: int,
        *,
        min_ngram: int = 1,
        max_ngram: int = MAX_NGRAM,
        history_texts: int = 16,
        history_prompts: int = 4096,
        pieces: int = 8,
    ):
        for name, value, least in (
            ("k", k, 1),
            ("min_ngram", min_ngram, 1),
            ("max_ngram", max_ngram, min_ngram),
            ("history_texts", history_texts, 0),
            ("history_prompts", history_prompts, 0),
            ("pieces", pieces, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        self.k, self.lo, self.hi, self.pieces = k, min_ngram, max_ngram, pieces
        self.history_texts, self.history_prompts = history_texts, history_prompts
        self._history: collections.OrderedDict[bytes, _History] = collections.OrderedDict()
        self.begin([], 1)

    def begin(self, prompts: Sequence[np.ndarray], n: int) -> None:
        """A request starts: ``n`` samples of each of ``prompts`` (1-D token ids)."""
        self.n = n
        self._prompts = [[int(t) for t in np.asarray(p).reshape(-1)] for p in prompts]
        self._keys = [np.asarray(p, np.int64).tobytes() for p in self._prompts]
        self._texts = [list(self._prompts[r // n]) for r in range(len(prompts) * n)]
        self._in_prompt = []  # per prompt: n-grams followed inside the prompt
        for i, prompt in enumerate(self._prompts):
            self._in_prompt.append(self._ngrams())
            self._in_prompt[i].add(0, prompt, 0, 0)
        self._own = [self._ngrams() for _ in self._texts]
        self._group = [self._ngrams() for _ in self._prompts]

    def _ngrams(self) -> _Ngrams:
        return _Ngrams(self.lo, self.hi, self.pieces)

    def window_size(self, steps: int) -> int:
        """A window whose first half holds :attr:`pieces` continuations of a chunk of ``steps``
        verify steps (each emits at most ``k + 1`` tokens), each led by up to ``max_ngram``
        tokens and followed by a -1, and whose second half holds as much again of the texts
        (:meth:`window`), rounded up to a power of two (one compiled program for every
        chunk)."""
        need = 2 * self.pieces * (self.hi + steps * (self.k + 1) + 1)
        return 1 << (need - 1).bit_length()

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        """Appends ``tokens`` to request row ``row``'s text."""
        text = self._texts[row]
        old = len(text)
        text.extend(int(t) for t in tokens)
        start = len(self._prompts[row // self.n])
        self._own[row].add(row, text, start, old)
        self._group[row // self.n].add(row, text, start, old)

    def drafts(self, rows: Sequence[int | None], size: int) -> Drafts:
        """A decode chunk's :class:`Drafts` for slots running request rows ``rows`` (None: an
        idle slot): each row's :meth:`window` of ``size`` tokens and its last ``max_ngram``
        tokens."""
        S, m = len(rows), self.hi
        out = Drafts(
            window=np.full((S, size), -1, np.int32),
            sources=np.full((S, size), -1, np.int32),
            tail=np.full((S, m), -1, np.int32),
        )
        for i, row in enumerate(rows):
            if row is not None:
                out.window[i], out.sources[i] = self.window(row, size)
                out.tail[i] = self.last(row, m)
        return out

    def extend_rows(self, rows: Sequence[int | None], tokens: np.ndarray, counts) -> None:
        """Appends ``tokens[i, :counts[i]]`` to each request row ``rows[i]`` (None: none)."""
        for i, row in enumerate(rows):
            if row is not None:
                self.extend(row, tokens[i, : counts[i]])

    def truncate(self, row: int, length: int) -> None:
        """Row ``row``'s text back to its prompt and first ``length`` tokens (a preempted
        sequence restarts from there and draws the same tokens again; its n-grams already
        recorded stay, pointing at the same text)."""
        del self._texts[row][len(self._prompts[row // self.n]) + length :]

    def last(self, row: int, m: int) -> np.ndarray:
        """Row ``row``'s last ``m`` tokens, int32, left-padded with -1."""
        tail = self._texts[row][-m:]
        return np.asarray([-1] * (m - len(tail)) + tail, np.int32)

    def propose(self, row: int) -> Draft:
        """Row ``row``'s draft: up to ``k`` tokens (none when no suffix of it occurred before)."""
        hits = self._hits(row)
        if not hits:
            return _NONE
        source, text, i, _ = hits[0]
        return Draft(np.asarray(text[i : i + self.k], np.int32), source)

    def _sources(self, row: int, p: int, history: _History | None) -> list:
        """``(source, n-grams, text of a document)`` in lookup order."""
        sources = [
            ("self", self._own[row], lambda doc: self._texts[doc]),
            ("self", self._in_prompt[p], lambda doc: self._prompts[p]),
            ("siblings", self._group[p], lambda doc: self._texts[doc]),
        ]
        if history is not None:
            sources.append(("history", history.ngrams, lambda doc: history.texts[doc]))
        return sources

    def window(self, row: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``row``'s draft window for a decode chunk: in its first half, the continuations
        of up to :attr:`pieces` occurrences of its last tokens (:meth:`propose`'s first), each
        led by the tokens it matched and followed by a -1; in the rest, whole texts in lookup
        order (:meth:`_texts_of`), each followed by a -1, as many as fit. The device looks the
        sequence's last tokens up in the window at every verify step
        (:func:`~delta_jax.sampling.speculation.speculate.lookup_drafts`, a vote among the first
        occurrences): at the chunk's start the longest suffix it finds is :meth:`propose`'s
        and its first occurrence is :meth:`propose`'s draft (no longer suffix occurs in the
        sources, and the first piece starts with the match); once the sequence has drawn
        tokens no piece goes on with, its new last tokens are found in the texts.

        Returns:
          ``(tokens, sources)``: int32 ``[size]`` (-1 pads), int8 ``[size]`` (each token's
          source's index in :data:`SOURCES`, -1 for pads).
        """
        tokens, sources = np.full(size, -1, np.int32), np.full(size, -1, np.int8)
        at = 0

        def put(source: str, piece: Sequence[int]) -> None:
            nonlocal at
            tokens[at : at + len(piece)] = piece
            sources[at : at + len(piece)] = SOURCES.index(source)
            at += len(piece) + 1

        hits = self._hits(row)
        share = size // 2 // max(len(hits), 1)
        for source, text, i, n in hits:
            put(source, text[i - n : i - n + share - 1])  # room for the -1 after it
        for source, text, begin in self._texts_of(row):
            if at >= size - 1:
                break
            put(source, text[begin : begin + size - at - 1])  # only what fits is copied
        return tokens, sources

    def _texts_of(self, row: int) -> list[tuple[str, list[int], int]]:
        """Row ``row``'s whole texts to draft from, in lookup order, as ``(source, text, index
        it starts at)``: its own (prompt included), its siblings' responses, then its prompt's
        earlier responses, the latest first."""
        p, n = row // self.n, self.n
        start = len(self._prompts[p])
        texts = [("self", self._texts[row], 0)]
        texts += [("siblings", self._texts[q], start) for q in range(p * n, p * n + n) if q != row]
        history = self._history.get(self._keys[p])
        if history is not None:
            texts += [("history", t, start) for t in reversed(history.texts)]
        return [(source, text, begin) for source, text, begin in texts if len(text) > begin]

    def _hits(self, row: int) -> list[tuple[str, list[int], int, int]]:
        """Up to :attr:`pieces` occurrences of row ``row``'s last tokens ``(source, text, index
        of the next token, tokens matched)``: the longest match first, then the sources in
        lookup order, then each source's own order (the earliest; in ``history`` the latest)."""
        text, p = self._texts[row], row // self.n
        history = self._history.get(self._keys[p])
        hits, seen = [], set()
        for n in range(min(self.hi, len(text)), self.lo - 1, -1):
            key = tuple(text[-n:])
            for source, ngrams, texts in self._sources(row, p, history):
                for doc, i in ngrams.find(n, key):
                    document = texts(doc)
                    if (id(document), i) not in seen and len(hits) < self.pieces:
                        seen.add((id(document), i))
                        hits.append((source, document, i, n))
        return hits

    def finish(self) -> None:
        """The request's texts join their prompts' history (bounded, see the class)."""
        if self.history_texts and self.history_prompts:
            for p, key in enumerate(self._keys):
                history = self._history.pop(key, None) or _History(
                    len(self._prompts[p]), self.lo, self.hi, self.history_texts, self.pieces
                )
                history.add(self._texts[p * self.n : (p + 1) * self.n])
                self._history[key] = history  # the most recently requested last
            while len(self._history) > self.history_prompts:
                self._history.popitem(last=False)
        self.begin([], 1)
