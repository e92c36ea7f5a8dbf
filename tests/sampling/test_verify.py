"""A verify step's acceptance and the slots' advance over several tokens, against NumPy oracles
of the rule: a drafted token is kept while it equals the token drawn at its index, and the
emitted tokens advance a slot as that many decode steps would (stops, budgets, stop
sequences)."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax.sampling.attention.paged import PageList
from delta_jax.sampling.engine.chunk import advance_by
from delta_jax.sampling.engine.decode import SlotState
from delta_jax.sampling.speculation.speculate import (
    accepted_path,
    line_trie,
    lookup_drafts,
    lookup_tree,
    next_tail,
)
from tests.sampling.test_paged import _flat


def _accepted(drafts, length, drawn):
    k = drafts.shape[1]
    start = jnp.zeros(drafts.shape[0], jnp.int32)
    return accepted_path(line_trie(drafts, length, start), drawn, k)[1]


def test_a_line_of_drafts_is_kept_up_to_the_first_draft_that_differs():
    rng = np.random.default_rng(0)
    S, k = 64, 4
    drawn = rng.integers(0, 3, (S, k + 1)).astype(np.int32)
    drafts = np.where(rng.random((S, k)) < 0.7, drawn[:, :k], rng.integers(0, 3, (S, k)))
    draft_len = rng.integers(0, k + 1, S).astype(np.int32)
    want = []
    for s in range(S):
        n = 1
        while n - 1 < draft_len[s] and drafts[s, n - 1] == drawn[s, n - 1]:
            n += 1
        want.append(n)
    got = _accepted(jnp.asarray(drafts, jnp.int32), jnp.asarray(draft_len), jnp.asarray(drawn))
    assert got.tolist() == want
    assert set(want) >= {1, 2, k + 1}  # rejections, partial and full acceptance all occur


def _slots(rng, S, window):
    fields = {
        "last": rng.integers(0, 9, S),
        "pos": rng.integers(5, 50, S),
        "count": rng.integers(0, 6, S),
        "active": rng.random(S) < 0.8,
        "max_new": rng.integers(3, 12, S),
        "seed": np.zeros(S),
        "prompt": np.arange(S),
        "sample": np.zeros(S),
        "row": np.arange(S),
        "copy_src": np.zeros(S),
        "copy_dst": np.zeros(S),
    }
    fields = {k: jnp.asarray(v, bool if k == "active" else jnp.int32) for k, v in fields.items()}
    stops = np.where(rng.random((S, 2)) < 0.5, rng.integers(0, 9, (S, 2)), -1)
    recent = rng.integers(-1, 9, (S, window))
    return SlotState(
        **fields,
        stops=jnp.asarray(stops, jnp.int32),
        recent=jnp.asarray(recent, jnp.int32),
        page_table=jnp.zeros((S, 1), jnp.int32),
        pages=PageList(*(jnp.zeros(1, jnp.int32) for _ in range(3))),
    )


def _oracle(s: SlotState, drawn, emit, patterns):
    """Each slot advanced one token at a time in plain Python."""
    out = {k: np.array(getattr(s, k)) for k in ("last", "pos", "count", "active", "recent")}
    for i in range(drawn.shape[0]):
        for j in range(emit[i]):
            if not out["active"][i]:
                break
            t = int(drawn[i, j])
            out["count"][i] += 1
            out["pos"][i] += 1
            out["last"][i] = t
            stop = t in np.asarray(s.stops[i]).tolist() or out["count"][i] >= s.max_new[i]
            if patterns is not None:
                out["recent"][i] = np.append(out["recent"][i][1:], t)
                for q in patterns:
                    stop |= bool(np.all((q < 0) | (out["recent"][i] == q)))
            out["active"][i] = not stop
    return out


@pytest.mark.parametrize("window", [0, 3])
def test_advance_by_equals_that_many_single_steps(window):
    rng = np.random.default_rng(window)
    S, k = 96, 3
    s = _slots(rng, S, window)
    drawn = rng.integers(0, 9, (S, k + 1))
    emit = rng.integers(1, k + 2, S)
    patterns = None
    if window:  # a two-id and a three-id stop sequence, right-aligned, -1 left
        patterns = np.array([[-1, 4, 5], [1, 2, 3]], np.int32)
    got = advance_by(s, jnp.asarray(drawn, jnp.int32), jnp.asarray(emit), patterns)
    want = _oracle(s, drawn, emit, patterns)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), value, err_msg=name)
    stopped = np.asarray(s.active) & ~want["active"]
    assert stopped.sum() > 5 and want["active"].sum() > 5  # both outcomes were exercised
    # one token at a time gives the same slots
    one = s
    for j in range(k + 1):
        ones = jnp.asarray(j < emit, jnp.int32)
        one = advance_by(one, jnp.asarray(drawn[:, j : j + 1], jnp.int32), ones, patterns)
    for name in want:
        np.testing.assert_array_equal(np.asarray(getattr(one, name)), want[name], err_msg=name)


def _lookup_oracle(window, tail, k, voters):
    """The draft voted by the continuations of the first ``voters`` places the window has the
    longest suffix of ``tail``, and where its lead's continuation starts."""
    D, m = len(window), len(tail)
    for n in range(m, 0, -1):
        key = list(tail[m - n :])
        if min(key) < 0:
            continue
        starts = [i for i in range(n, D) if list(window[i - n : i]) == key and window[i] >= 0]
        if not starts:
            continue
        conts = {}
        for i in starts[:voters]:
            c = []
            for t in window[i : i + k]:
                if t < 0:
                    break
                c.append(int(t))
            conts[i] = c
        draft, alive = [], list(conts)
        while len(draft) < k:
            going = [i for i in alive if len(conts[i]) > len(draft)]
            if not going:
                break
            counts = Counter(conts[i][len(draft)] for i in going)
            top = max(counts.values())
            # the most voted token; between equals, the one of the earliest occurrence
            token = next(conts[i][len(draft)] for i in going if counts[conts[i][len(draft)]] == top)
            draft.append(token)
            alive = [i for i in going if conts[i][len(draft) - 1] == token]
        return draft, alive[0]
    return [], -1


def test_lookup_drafts_and_next_tail_match_a_scan():
    rng = np.random.default_rng(7)
    S, D, m, k = 256, 12, 3, 3
    window = rng.integers(0, 3, (S, D))
    window[rng.random((S, D)) < 0.15] = -1
    tail = rng.integers(0, 3, (S, m))
    tail[rng.random((S, m)) < 0.1] = -1
    for s_ in range(S):  # a short sequence: -1 only on the left
        short = int(np.max(np.nonzero(tail[s_] < 0)[0], initial=-1))
        tail[s_, : short + 1] = -1
    emitted = rng.integers(0, 3, (S, k + 1))
    taken = rng.integers(0, k + 2, S)
    j = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    voters = 3
    drafts, length, start = lookup_drafts(j(window), j(tail), k, voters)
    first, first_length, first_start = lookup_drafts(j(window), j(tail), k, voters=1)
    new_tail = next_tail(j(tail), j(emitted), j(taken))
    matched, outvoted = set(), 0
    for s_ in range(S):
        want, at = _lookup_oracle(window[s_], tail[s_], k, voters)
        alone, alone_at = _lookup_oracle(window[s_], tail[s_], k, 1)  # the first occurrence's
        assert np.asarray(first[s_, : first_length[s_]]).tolist() == alone, s_
        assert int(first_start[s_]) == alone_at
        outvoted += alone_at != at
        assert np.asarray(drafts[s_, : length[s_]]).tolist() == want, s_
        assert (np.asarray(drafts[s_, length[s_] :]) == 0).all() and int(start[s_]) == at
        after = list(tail[s_]) + list(emitted[s_, : taken[s_]])
        assert np.asarray(new_tail[s_]).tolist() == after[-m:], s_
        if at >= 0:  # the length of the suffix it matched on
            same = [
                n
                for n in range(1, m + 1)
                if list(window[s_, at - n : at]) == list(tail[s_, m - n :])
            ]
            matched.add(max(same))
    assert matched == {1, 2, 3}, matched  # every suffix length was the longest somewhere
    assert outvoted > 10  # the vote often chose another continuation than the first one's
    assert (np.asarray(length) == 0).any() and (np.asarray(length) == k).any()


def test_a_sequence_whose_window_holds_its_text_drafts_it_all():
    # A slot whose window is the text it goes on to draw, after a decoy piece that shares its
    # last token only: each step finds the longer match, emits k + 1 tokens (k drafts and the
    # token after them) and looks its new tail up again.
    text = np.arange(10, 30)
    window = np.concatenate([[9, 50, 51, -1], [7, 8, 9], text, [-1]])
    window = jnp.asarray(window[None], jnp.int32)
    tail, k = jnp.array([[7, 8, 9]]), 3
    at = 0
    while at + k + 1 <= len(text):
        drafts, length, start = lookup_drafts(window, tail, k)
        assert np.asarray(drafts[0]).tolist() == text[at : at + k].tolist() and int(length[0]) == k
        assert int(start[0]) == 7 + at
        drawn = jnp.asarray(text[None, at : at + k + 1], jnp.int32)
        taken = _accepted(drafts, length, drawn)
        assert int(taken[0]) == k + 1
        tail = next_tail(tail, drawn, taken)
        at += k + 1
        assert np.asarray(tail[0]).tolist() == text[at - 3 : at].tolist()


def _decode_all(
    model, backend, strategy, prompts, budgets, stops, windows=None, k=0, m=2, depth=0, stats=None
):
    """Every slot decoded to its end from its prompt's pages: verify steps with ``k`` drafts
    (a trie ``depth`` deep; 0: a line) from ``windows`` (k = 0: plain decode steps), in one
    decode chunk. Returns per slot its tokens, log-probs and hidden states, and the number of
    steps; ``stats`` (a dict) counts the steps whose kept path left the first branch."""
    from flax import nnx

    from delta_jax.sampling.attention.paged import Tokens, init_pool, paged_forward
    from delta_jax.sampling.engine.chunk import speculative_step
    from delta_jax.sampling.engine.decode import DecodeOptions, token_sampler

    # Room for every verify step's k + 1 columns in the dense path's views.
    S, page_size, per_seq = len(prompts), 4, 16 if backend.name != "dense" else 64
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(S)]
    flat = {k_: jnp.asarray(v) for k_, v in _flat(tables, S, S * per_seq).items()}
    pages = PageList(**flat)
    table = jnp.asarray(tables, jnp.int32)  # what the Pallas path reads
    pool = init_pool(model, 1 + S * per_seq, page_size, jnp.float32)
    layers = model.layer_params()
    # The prompts but their last tokens into their pages; the last is fed by the first step.
    P = max(map(len, prompts)) - 1
    ids = np.zeros((S, P), np.int32)
    valid = np.zeros((S, P), bool)
    for b, p in enumerate(prompts):
        ids[b, : len(p) - 1], valid[b, : len(p) - 1] = p[:-1], True
    positions = jnp.broadcast_to(jnp.arange(P), (S, P))
    prompt = Tokens(jnp.asarray(ids), positions, jnp.asarray(valid))
    _, pool = paged_forward(model, layers, prompt, pool, pages)
    s = SlotState(
        last=jnp.asarray([p[-1] for p in prompts], jnp.int32),
        pos=jnp.asarray([len(p) - 1 for p in prompts], jnp.int32),
        count=jnp.zeros(S, jnp.int32),
        active=jnp.ones(S, bool),
        max_new=jnp.asarray(budgets, jnp.int32),
        seed=jnp.full(S, 5, jnp.int32),
        prompt=jnp.arange(S, dtype=jnp.int32),
        sample=jnp.zeros(S, jnp.int32),
        row=jnp.arange(S, dtype=jnp.int32),
        stops=jnp.asarray(stops, jnp.int32)[:, None],
        recent=jnp.zeros((S, 0), jnp.int32),
        page_table=table,
        pages=pages,
        copy_src=jnp.zeros(S, jnp.int32),
        copy_dst=jnp.zeros(S, jnp.int32),
    )
    draw = token_sampler(model, strategy, return_hidden=True, pad_id=0)
    window = jnp.full((S, 1), -1, jnp.int32) if windows is None else jnp.asarray(windows)
    tail = jnp.asarray([p[-m:] for p in prompts], jnp.int32)
    state, _ = backend.begin_chunk(pool, s, dict(tokens=jnp.zeros((S, 1))), True)
    options = DecodeOptions(nnx.graphdef(model), backend, 1, draft_tokens=k, draft_depth=depth)

    @jax.jit
    def step(s, state, tail):
        return speculative_step(options, model, layers, draw, s, state, window, tail)

    out = [dict(tokens=[], logprobs=[], hidden=[]) for _ in range(S)]
    steps = 0
    while bool(s.active.any()):
        live = np.asarray(s.active)
        s, state, v = step(s, state, tail)
        tail = v.tail
        steps += 1
        path, taken = np.asarray(v.path), np.asarray(v.taken)
        for b in range(S):
            for name in out[b]:
                out[b][name] += list(np.asarray(v.cols[name][b, : taken[b]]))
            if stats is not None and live[b]:
                off = (path[b, : taken[b]] != np.arange(taken[b])).any()
                stats["off_branch"] = stats.get("off_branch", 0) + int(off)
    return out, steps


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_steps_emit_the_tokens_of_plain_decoding(temperature):
    """Verify steps on the XLA paged path with drafts read from windows (the plain run's own
    text, partly corrupted, so drafts are accepted, rejected and found again): the same tokens,
    log-probs and hidden states as plain decode steps, in fewer steps. Greedy and sampled:
    a token is drawn with its index's key either way."""
    from flax import nnx

    from delta_jax.models import ModelConfig, Transformer
    from delta_jax.sampling.attention.backends import XlaBackend
    from delta_jax.sampling.strategies import make_strategy

    model = Transformer(ModelConfig.tiny("qwen3", vocab_size=24), rngs=nnx.Rngs(1))
    strategy = make_strategy(temperature)
    prompts = [np.array([3, 4, 5]), np.array([7, 1, 2, 9, 9]), np.array([5, 6]), np.array([8] * 6)]
    budgets, stops = [20, 25, 9, 30], [-1, -1, 11, -1]
    plain, plain_steps = _decode_all(model, XlaBackend(), strategy, prompts, budgets, stops)
    rng = np.random.default_rng(0)
    D, m = 40, 2
    windows = np.full((len(prompts), D), -1, np.int32)
    for b, p in enumerate(prompts):
        text = np.array(plain[b]["tokens"], np.int32)
        noisy = np.where(rng.random(text.size) < 0.15, rng.integers(0, 24, text.size), text)
        piece = np.concatenate([p[-m:], noisy])[: D - 1]
        windows[b, : piece.size] = piece
    spec, spec_steps = _decode_all(
        model, XlaBackend(), strategy, prompts, budgets, stops, windows, k=3, m=m
    )
    for b in range(len(prompts)):
        assert spec[b]["tokens"] == plain[b]["tokens"], b
        np.testing.assert_allclose(spec[b]["logprobs"], plain[b]["logprobs"], atol=1e-5)
        np.testing.assert_allclose(spec[b]["hidden"], plain[b]["hidden"], atol=1e-5)
    assert len(plain[2]["tokens"]) <= 9 and len(plain[3]["tokens"]) == 30
    assert spec_steps < plain_steps == max(len(o["tokens"]) for o in plain)


@pytest.mark.parametrize("attention", ["xla", "dense"])
def test_trie_verify_steps_emit_the_tokens_of_plain_decoding(attention):
    """Verify steps of tries of 6 drafts 3 deep, from windows that hold the plain run's text
    once after two corrupted copies of it: where they differ the copies outvote the text, so
    the drawn token is often a second child, and the kept path leaves the first branch (its
    K/V move to the positions after the root on the XLA path; on the dense path its columns
    become the visible ones). Sampled: the same tokens, log-probs and hidden states as plain
    decode steps, in fewer steps."""
    from flax import nnx

    from delta_jax.models import ModelConfig, Transformer
    from delta_jax.sampling.attention.backends import backend_for
    from delta_jax.sampling.strategies import make_strategy

    model = Transformer(ModelConfig.tiny("qwen3", vocab_size=24), rngs=nnx.Rngs(1))
    strategy = make_strategy(1.0)
    prompts = [np.array([3, 4, 5]), np.array([7, 1, 2, 9, 9]), np.array([5, 6])]
    budgets, stops = [20, 25, 9], [-1, -1, 11]
    backend = backend_for(attention)
    plain, plain_steps = _decode_all(model, backend, strategy, prompts, budgets, stops)
    windows = trie_windows(plain, prompts, np.random.default_rng(2), vocab=24, m=2)
    stats = {}
    spec, spec_steps = _decode_all(
        model, backend, strategy, prompts, budgets, stops, windows, k=6, m=2, depth=3,
        stats=stats,
    )  # fmt: skip
    for b in range(len(prompts)):
        assert spec[b]["tokens"] == plain[b]["tokens"], b
        np.testing.assert_allclose(spec[b]["logprobs"], plain[b]["logprobs"], atol=1e-5)
        np.testing.assert_allclose(spec[b]["hidden"], plain[b]["hidden"], atol=1e-5)
    assert stats["off_branch"] >= 3, stats
    assert spec_steps < plain_steps


def trie_windows(plain, prompts, rng, vocab: int, m: int, width: int = 128):
    """Windows holding each sequence's plain text once, after two copies of it with 30% of the
    tokens replaced (each copy and the text after the prompt's last ``m`` tokens): where they
    differ the copies outvote the text, so a trie's drawn token is often a second child."""
    windows = np.full((len(prompts), width), -1, np.int32)
    for b, p in enumerate(prompts):
        text = np.array(plain[b]["tokens"], np.int32)
        pieces = []
        for _ in range(2):
            noisy = np.where(rng.random(text.size) < 0.3, rng.integers(0, vocab, text.size), text)
            pieces += [p[-m:], noisy, [-1]]
        piece = np.concatenate([*pieces, p[-m:], text])[: width - 1]
        windows[b, : piece.size] = piece
    return windows


def _trie_oracle(window, tail, nodes, depth, voters, backoff):
    """The paths of the ``nodes`` continuations most of the first ``voters`` occurrences of the
    longest suffix of ``tail`` go on with (ties: shallower, then the earlier occurrence); with
    ``backoff``, of the first ``voters`` occurrences of its suffixes, the longest matches first,
    a path ranked by its longest match, then as before."""
    D, m = len(window), len(tail)
    matched = {}  # occurrence -> the longest suffix that ends before it
    for n in range(1, m + 1):
        key = list(tail[m - n :])
        for i in range(n, D):
            if window[i] >= 0 and min(key) >= 0 and list(window[i - n : i]) == key:
                matched[i] = n
    starts = sorted(matched, key=lambda i: (-matched[i], i))
    if not backoff:
        starts = [i for i in starts if matched[i] == max(matched.values())]
    seen = {}  # path -> [count, longest match, first occurrence]
    for o, i in enumerate(starts[:voters]):
        path = ()
        for t in window[i : i + depth]:
            if t < 0:
                break
            path += (int(t),)
            seen.setdefault(path, [0, matched[i], o])[0] += 1
    rank = lambda p: (-seen[p][1], -seen[p][0], len(p), seen[p][2])  # noqa: E731
    return sorted(seen, key=rank)[:nodes]


@pytest.mark.parametrize("backoff", [False, True])
@pytest.mark.parametrize(("nodes", "depth"), [(4, 4), (8, 3), (16, 6)])
def test_lookup_tree_matches_a_scan(nodes, depth, backoff):
    rng = np.random.default_rng(nodes)
    S, D, m, voters = 200, 40, 3, 5
    window = rng.integers(0, 3, (S, D))
    window[rng.random((S, D)) < 0.1] = -1
    tail = rng.integers(0, 3, (S, m))
    j = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    trie = lookup_tree(j(window), j(tail), nodes, depth, voters, backoff)
    tokens, parent, level, where = map(
        np.asarray, (trie.tokens, trie.parent, trie.level, trie.where)
    )
    count = np.asarray(trie.real).sum(1)
    assert (np.asarray(trie.real) == (np.arange(nodes) < count[:, None])).all()
    full = 0
    for s in range(S):
        want = _trie_oracle(window[s], tail[s], nodes, depth, voters, backoff)
        paths = []
        for i in range(count[s]):
            assert parent[s, i] < i  # a parent comes before its children
            above = () if parent[s, i] < 0 else paths[parent[s, i]]
            paths.append((*above, int(tokens[s, i])))
            assert len(paths[-1]) == level[s, i]
            # the token's place in the window: the path, after the tail's longest suffix
            w = where[s, i]
            assert window[s, w - level[s, i] + 1 : w + 1].tolist() == list(paths[-1])
        assert paths == want, s
        assert (parent[s, count[s] :] == -1).all() and (level[s, count[s] :] == 0).all()
        full += count[s] == nodes
    assert 0 < full and (full < S or backoff)  # full tries, and smaller ones without backoff
    if backoff:  # the shorter suffixes' occurrences changed tries
        plain = lookup_tree(j(window), j(tail), nodes, depth, voters, backoff=False)
        assert (np.asarray(plain.tokens) != tokens).any(axis=1).sum() > S // 10


def test_accepted_path_keeps_the_drawn_tokens_down_the_trie():
    rng = np.random.default_rng(3)
    S, D, m, nodes, depth = 300, 40, 3, 8, 5
    window = rng.integers(0, 3, (S, D))
    tail = rng.integers(0, 3, (S, m))
    j = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    trie = lookup_tree(j(window), j(tail), nodes, depth, 6)
    drawn = rng.integers(0, 3, (S, nodes + 1))
    positions, taken = map(np.asarray, accepted_path(trie, j(drawn), depth))
    tokens, parent = map(np.asarray, (trie.tokens, trie.parent))
    count = np.asarray(trie.real).sum(1)
    lengths = set()
    for s in range(S):
        # The oracle: the emitted tokens are the drawn ones along the path; each kept node's
        # token is the token drawn at its parent's position.
        children = {}
        for i in range(count[s]):
            children.setdefault(int(parent[s, i]) + 1, {})[int(tokens[s, i])] = i + 1
        want = [0]
        while (nxt := children.get(want[-1], {}).get(int(drawn[s, want[-1]]))) is not None:
            want.append(nxt)
        assert positions[s, : taken[s]].tolist() == want, s
        assert (positions[s, taken[s] :] == 0).all()
        lengths.add(int(taken[s]))
    assert {1, 2, 3} <= lengths  # rejected at once, one and two nodes kept
