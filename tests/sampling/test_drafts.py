"""Drafts from the rollout's own text: the drafter's proposals against a brute-force scan of
every source, over random requests (history and its bounds included)."""

import numpy as np
import pytest

from delta_jax.sampling.speculation.drafts import SOURCES, Drafter


class Oracle:
    """The drafter's rule by exhaustive search: every (text, index) an n-gram was followed at,
    stamped in the order tokens arrived."""

    def __init__(self, k, lo, hi, history_texts, history_prompts):
        self.k, self.lo, self.hi = k, lo, hi
        self.keep, self.prompts_kept = history_texts, history_prompts
        self.history = {}  # prompt bytes -> list of texts, oldest first
        self.order = []  # prompt bytes, least recently requested first

    def begin(self, prompts, n):
        self.n, self.prompts = n, [list(map(int, p)) for p in prompts]
        self.texts = [list(self.prompts[r // n]) for r in range(len(prompts) * n)]
        self.stamps = [[None] * len(t) for t in self.texts]
        self.clock = 0

    def extend(self, row, tokens):
        for t in tokens:
            self.texts[row].append(int(t))
            self.stamps[row].append(self.clock)
            self.clock += 1

    def propose(self, row):
        text, p = self.texts[row], row // self.n
        P = len(self.prompts[p])
        key_of = bytes(np.asarray(self.prompts[p], np.int64))
        for n in range(min(self.hi, len(text)), self.lo - 1, -1):
            key = text[-n:]

            def hits(t, lo, hi, n=n, key=key):
                return [i for i in range(max(lo, n), min(hi, len(t))) if t[i - n : i] == key]

            # the first occurrence in the sequence's own text, its prompt, its siblings' texts
            # (the earliest to arrive); the newest earlier text's latest occurrence
            own = hits(text, P, len(text))
            if own:
                return text[min(own) : min(own) + self.k], "self"
            inside = hits(self.prompts[p], 0, P)
            if inside:
                return self.prompts[p][min(inside) : min(inside) + self.k], "self"
            rows = range(p * self.n, (p + 1) * self.n)
            sib = [(self.stamps[r][i], r, i) for r in rows for i in hits(self.texts[r], P, 10**9)]
            if sib:
                _, r, i = min(sib)
                return self.texts[r][i : i + self.k], "siblings"
            old = self.history.get(key_of, [])
            past = [(d, i) for d, t in enumerate(old) for i in hits(t, P, 10**9)]
            if past:
                d, i = max(past)
                return old[d][i : i + self.k], "history"
        return [], None

    def texts_of(self, row):
        """The whole texts a window holds after its pieces: the row's own (prompt included),
        its siblings' responses, its prompt's earlier responses (the latest first)."""
        p, P = row // self.n, len(self.prompts[row // self.n])
        siblings = [self.texts[r][P:] for r in range(p * self.n, (p + 1) * self.n) if r != row]
        old = self.history.get(bytes(np.asarray(self.prompts[p], np.int64)), [])
        return [t for t in [self.texts[row], *siblings, *[t[P:] for t in old[::-1]]] if t]

    def finish(self):
        if self.keep and self.prompts_kept:
            for p, prompt in enumerate(self.prompts):
                key = bytes(np.asarray(prompt, np.int64))
                texts = self.history.get(key, []) + self.texts[p * self.n : (p + 1) * self.n]
                self.history[key] = texts[-self.keep :]
                if key in self.order:
                    self.order.remove(key)
                self.order.append(key)
            while len(self.order) > self.prompts_kept:
                del self.history[self.order.pop(0)]


def lookup(window: list[int], tail: list[int]) -> int:
    """Where the device drafts from (``speculate.lookup_drafts``, by a scan): after the first
    place the window has the longest suffix of ``tail``; -1 where none."""
    for n in range(len(tail), 0, -1):
        for i in range(n, len(window)):
            if window[i - n : i] == tail[-n:] and window[i] >= 0:
                return i
    return -1


@pytest.mark.parametrize(
    ("k", "lo", "hi", "texts", "prompts"), [(3, 1, 3, 16, 8), (4, 2, 4, 3, 2), (2, 2, 2, 0, 4)]
)
def test_drafts_match_an_exhaustive_search(k, lo, hi, texts, prompts):
    rng = np.random.default_rng(k * 100 + lo * 10 + hi)
    drafter = Drafter(k, min_ngram=lo, max_ngram=hi, history_texts=texts, history_prompts=prompts)
    oracle = Oracle(k, lo, hi, texts, prompts)
    pool = [rng.integers(0, 5, rng.integers(1, 7)) for _ in range(4)]  # prompts come back
    seen = dict.fromkeys(SOURCES, 0)
    for _ in range(6):  # requests
        picked = [pool[i] for i in rng.choice(len(pool), 3, replace=False)]
        n = int(rng.integers(1, 4))
        drafter.begin(picked, n)
        oracle.begin(picked, n)
        for _ in range(40):
            row = int(rng.integers(0, 3 * n))
            tokens = rng.integers(0, 5, rng.integers(1, 4)).tolist()
            drafter.extend(row, tokens)
            oracle.extend(row, tokens)
            for r in range(3 * n):
                want, source = oracle.propose(r)
                got = drafter.propose(r)
                assert got.tokens.tolist() == want and got.source == source, (r, want, source)
                assert got.tokens.dtype == np.int32 and len(got.tokens) <= k
                # The chunk's window: looked up by the row's last max_ngram tokens (as the
                # device does at the chunk's first step), the same draft.
                tokens, sources = drafter.window(r, drafter.window_size(1))
                if source is None:  # no piece: the whole texts from the window's start
                    layout = sum((t + [-1] for t in oracle.texts_of(r)), [])[: len(tokens)]
                    layout[-1] = -1
                    assert tokens.tolist() == layout + [-1] * (len(tokens) - len(layout))
                    assert sources[0] == SOURCES.index("self")
                else:
                    at = lookup(tokens.tolist(), oracle.texts[r][-hi:])
                    assert tokens[at : at + len(want)].tolist() == want
                    assert sources[at] == SOURCES.index(source)
                    assert ((tokens == -1) == (sources == -1)).all() and tokens[-1] == -1
                seen[source] = seen.get(source, 0) + 1
        drafter.finish()
        oracle.finish()
    # Every source was exercised (history only where it is kept).
    assert all(seen[s] > 0 for s in ("self", "siblings"))
    assert (seen["history"] > 0) == (texts > 0)


def test_a_window_holds_the_whole_texts_after_its_pieces():
    """Drawing a token that no piece of the chunk goes on with, a sequence drafts from the whole
    texts after the pieces: its own, its siblings', its prompt's earlier responses."""
    d = Drafter(2, min_ngram=1, max_ngram=2, pieces=1)
    d.begin([np.array([1, 2, 3])], n=2)
    d.extend(0, [4, 5, 6])
    d.extend(1, [4, 7, 8])
    d.finish()
    d.begin([np.array([1, 2, 3])], n=2)
    d.extend(0, [4])
    d.extend(1, [9])
    tokens, sources = d.window(0, 32)
    # One piece (the latest earlier response after "3 4"), then the texts in lookup order.
    history, siblings = SOURCES.index("history"), SOURCES.index("siblings")
    expect = [(3, 4, 7, 8), (1, 2, 3, 4), (9,), (4, 7, 8), (4, 5, 6)]
    where = [history, 0, siblings, history, history]
    at = 0
    for piece, source in zip(expect, where, strict=True):
        assert tokens[at : at + len(piece) + 1].tolist() == [*piece, -1]
        assert (sources[at : at + len(piece)] == source).all() and sources[at + len(piece)] == -1
        at += len(piece) + 1
    assert (tokens[at:] == -1).all() and (sources[at:] == -1).all()
    # The row draws 5 after 4 (the piece went on with 7): "4 5" is found in the older response.
    at = lookup(tokens.tolist(), [4, 5])
    assert tokens[at] == 6 and sources[at] == history


def test_a_sibling_ahead_drafts_the_shared_text_and_history_the_first_tokens():
    prompt = np.array([1, 2, 3])
    d = Drafter(4, min_ngram=2, max_ngram=3)
    d.begin([prompt], n=2)
    assert d.propose(0).source is None  # "2 3" was never followed by anything
    d.extend(0, [10, 11, 12, 13, 14])
    d.extend(1, [10])
    # Sample 1 follows "3 10" the way sample 0 did.
    assert d.propose(1).tokens.tolist() == [11, 12, 13, 14]
    d.extend(1, [11, 12, 99])
    d.finish()
    d.begin([prompt, np.array([9, 9])], n=1)
    first = d.propose(0)  # the prompt's end, followed by the latest response's first tokens
    assert (first.tokens.tolist(), first.source) == ([10, 11, 12, 99], "history")
    assert d.propose(1).source is None  # a new prompt: its "9 9" was never followed


@pytest.mark.parametrize(
    "kwargs",
    [dict(k=0), dict(k=2, min_ngram=0), dict(k=2, min_ngram=3, max_ngram=2), dict(k=True)],
)
def test_bad_settings_are_one_line(kwargs):
    k = kwargs.pop("k")
    with pytest.raises(ValueError, match="must be an int >=") as err:
        Drafter(k, **kwargs)
    assert "\n" not in str(err.value)


def test_a_chunks_drafts_and_a_preempted_rows_text():
    """``drafts``: each running row's window, its place after the first piece's lead and its
    last tokens (idle slots: nothing); ``truncate``: a preempted row drafts from its text up to
    where it restarts, and the same tokens arriving again draft as before."""
    d = Drafter(3, min_ngram=2, max_ngram=2)
    d.begin([np.array([1, 2, 3])], n=2)
    d.extend(0, [4, 5, 6, 7])
    d.extend(1, [4])
    chunk = d.drafts([1, None, 0], size=16)
    window, sources = d.window(1, 16)
    assert (chunk.window[0] == window).all() and (chunk.sources[0] == sources).all()
    assert window[:2].tolist() == [3, 4] and window[2:5].tolist() == [5, 6, 7]  # sibling 0's
    # Row 0's "6 7" was never followed: no piece, its own text and its sibling's from the start.
    assert chunk.window[2].tolist() == [1, 2, 3, 4, 5, 6, 7, -1, 4] + [-1] * 7
    assert chunk.tail.tolist() == [[3, 4], [-1, -1], [6, 7]]
    assert (chunk.window[1] == -1).all() and (chunk.sources[1] == -1).all()
    d.extend_rows([0, None, 1], np.array([[8, 9, -1], [0, 0, 0], [5, 6, -1]]), [1, 0, 2])
    assert d.last(0, 3).tolist() == [6, 7, 8] and d.last(1, 3).tolist() == [4, 5, 6]
    before = d.propose(1)
    d.truncate(1, 1)  # back to its prompt and first token
    assert d.last(1, 3).tolist() == [2, 3, 4]
    d.extend(1, [5, 6])
    after = d.propose(1)
    assert after.tokens.tolist() == before.tokens.tolist() and after.source == before.source
