"""How many tokens per verify step drafts from the rollout's own text can reach on the real model,
replayed on its recorded rollouts, for several drafting rules.

A drafted token is accepted exactly when it equals the token the sequence draws at that index
with its own key (:mod:`delta_jax.sampling.speculation.speculate`): the draws do not depend on the
drafts. So rollouts recorded once, without speculation, replay any drafting rule exactly, without
the model. This records ``--epochs`` requests of the same prompts (``benchmarks/speculative.py``'s
workload: ``configs/smollm2_arith.yaml``, SmolLM2-135M-Instruct, reasoning-gym ``chain_sum``,
temperature 0.7, ``--n`` samples per prompt; the first epoch only fills the history), then
replays one verify step at a time, a prompt's samples advancing together (a sibling's text is
what it has drawn so far), for each rule:

* ``first``: the drafter's own rule (:meth:`~delta_jax.sampling.speculation.drafts.Drafter.propose`:
  the continuation of the first occurrence of the longest matched suffix, sources in order) asked
  afresh at every verify step. The engine renews its drafts once per decode chunk and follows
  them on the device in between (``benchmarks/speculative.py`` measures that);
* ``frequent``: every occurrence of the longest matched suffix (up to ``max_ngram`` tokens) in
  all sources votes for its next token, the most frequent is drafted, and the occurrences that
  agree vote for the one after it (also with the ``history`` or the ``siblings`` left out);
* ``tree``: a verify step that checks a trie of up to ``--tree-nodes`` drafted tokens (up to
  ``--tree-depth`` deep) instead of one line of ``k``: the continuations of the occurrences of the
  longest matched suffix, the nodes most occurrences pass through (ties: the shallower); the
  step keeps the longest path of the trie that the sequence draws (the draws do not depend on
  the drafts, so this is exact too);
* ``best-match``: an upper bound for any rule that copies text following an occurrence of the
  row's last token: the occurrence whose continuation matches the row's future the longest
  (a rule that knew the draws);
* ``window``: what the engine drafts from. Every ``--chunk`` verify steps each row gets the
  drafter's window (:meth:`~delta_jax.sampling.speculation.drafts.Drafter.window`, the sequences'
  texts as the chunk starts); at every step its draft is the device's own lookup
  (:func:`~delta_jax.sampling.speculation.speculate.lookup_drafts`, the vote of the first
  :data:`~delta_jax.sampling.speculation.speculate.VOTERS` occurrences) in that window, or, for the
  tries, the trie of the continuations of those occurrences (the ``tree`` rule's choice of nodes, in
  the window).

    python benchmarks/draft_replay.py --prompts 16 --epochs 4 --max-new 128 [--rules tree] --set \\
      "data.template={prompt} Explain your reasoning step by step, then give the final number."
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from delta_jax.config import load_config
from delta_jax.rl.setup import load_model, prompt_sets, special_token_ids
from delta_jax.sampling import Sampler
from delta_jax.sampling.speculation.drafts import MAX_NGRAM, Drafter
from delta_jax.sampling.speculation.speculate import VOTERS, lookup_drafts

CONFIG = "configs/smollm2_arith.yaml"
RULES = ("first", "frequent", "best-match", "tree", "window")


def record(args) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The prompts and every epoch's responses (rows ``prompt * n + sample``)."""
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"run.dir={run_dir}", "run.eval_every=0", "data.extra_eval_sources=null"]
        config = load_config(CONFIG, overrides + args.set)
        model, tokenizer = load_model(config, Path(run_dir))
        pad_id, stops = special_token_ids(tokenizer, model)
        train, _ = prompt_sets(config, tokenizer)
        prompts = [list(map(int, ids)) for ids in train.ids[: args.prompts]]
    sampler = Sampler(
        model, engine="continuous", pad_token_id=pad_id, stop_token_ids=stops,
        decode_slots=len(prompts) * args.n,
    )  # fmt: skip
    epochs = []
    for epoch in range(args.epochs):
        start = time.perf_counter()
        out = sampler.generate(
            prompts, max_new_tokens=args.max_new, n=args.n, temperature=args.temperature,
            seed=1000 + epoch,
        )  # fmt: skip
        epochs.append([list(map(int, row)) for row in out.tokens])
        print(f"epoch {epoch}: {sum(out.lengths)} tokens in {time.perf_counter() - start:.0f} s")
    return prompts, epochs


def _occurrences(docs, key: tuple[int, ...]) -> list[tuple[list[int], int]]:
    """``(text, i)`` for every ``i >= start`` of every ``(text, start)`` in ``docs`` that
    ``key`` ends just before."""
    n = len(key)
    return [
        (text, i)
        for text, start in docs
        for i in range(max(start, n), len(text))
        if tuple(text[i - n : i]) == key
    ]


def _longest_match(context, docs) -> list[tuple[list[int], int]]:
    """The occurrences of the longest suffix of ``context`` (up to ``MAX_NGRAM`` tokens) that
    occurs in ``docs`` (none: [])."""
    for n in range(min(MAX_NGRAM, len(context)), 0, -1):
        alive = _occurrences(docs, tuple(context[-n:]))
        if alive:
            return alive
    return []


def frequent(context, docs, k: int) -> list[int]:
    """Up to ``k`` tokens voted by the occurrences of the longest matched suffix."""
    alive = _longest_match(context, docs)
    draft = []
    for j in range(k):
        votes = collections.Counter(t[i + j] for t, i in alive if i + j < len(t))
        if not votes:
            break
        token = votes.most_common(1)[0][0]
        draft.append(token)
        alive = [(t, i) for t, i in alive if i + j < len(t) and t[i + j] == token]
    return draft


def tree(context, docs, depth: int, nodes: int) -> set[tuple[int, ...]]:
    """The trie (its nodes as token prefixes) of the ``nodes`` continuations (up to ``depth``
    tokens) that most occurrences of the longest matched suffix go on with."""
    counts = collections.Counter(
        tuple(t[i : i + j])
        for t, i in _longest_match(context, docs)
        for j in range(1, min(depth, len(t) - i) + 1)
    )  # a prefix is counted at least as often as its extensions: the set is a trie
    return set(sorted(counts, key=lambda path: (-counts[path], len(path)))[:nodes])


def best_match(context, docs, future, k: int) -> list[int]:
    """The continuation (up to ``k``) of an occurrence of the last token that matches
    ``future`` the longest."""
    best: list[int] = []
    for text, i in _occurrences(docs, tuple(context[-1:])):
        piece = text[i : i + k]
        j = 0
        while j < len(piece) and j < len(future) and piece[j] == future[j]:
            j += 1
        if j > len(best):
            best = piece[:j]
    return best


def replay(prompts, epochs, n: int, k: int, rule: str, sources=("siblings", "history"), nodes=0):
    """Tokens per verify step of ``rule`` over epochs 1 onwards (``tree``: a trie of ``nodes``
    drafted tokens up to ``k`` deep)."""
    drafter = Drafter(k)  # its defaults; the replay keeps as much history
    steps = tokens = 0
    for e, rows in enumerate(epochs):
        drafter.begin([np.asarray(p) for p in prompts], n)
        for p, prompt in enumerate(prompts):
            group = range(p * n, (p + 1) * n)
            history = [(prompt + old[r], len(prompt)) for old in epochs[:e] for r in group][
                -drafter.history_texts :
            ]
            at = dict.fromkeys(group, 0)
            while any(at[r] < len(rows[r]) for r in group):
                emitted = {}
                for r in (r for r in group if at[r] < len(rows[r])):
                    context, future = prompt + rows[r][: at[r]], rows[r][at[r] :]
                    docs = [(context, 0)]  # its own text and prompt
                    if "siblings" in sources:
                        docs += [(prompt + rows[q][: at[q]], len(prompt)) for q in group if q != r]
                    if "history" in sources:
                        docs += history
                    if rule == "first":
                        draft = drafter.propose(r).tokens.tolist()
                    elif rule == "frequent":
                        draft = frequent(context, docs, k)
                    elif rule == "best-match":
                        draft = best_match(context, docs, future, k)
                    if rule == "tree":
                        trie = tree(context, docs, k, nodes)
                    else:  # one line of drafts: the trie of its prefixes
                        trie = {tuple(draft[:j]) for j in range(1, len(draft) + 1)}
                    taken = 1  # the drawn token, then each drafted token the row drew next
                    while taken < len(future) and tuple(future[:taken]) in trie:
                        taken += 1
                    emitted[r] = future[:taken]
                for r, toks in emitted.items():
                    drafter.extend(r, toks)
                    at[r] += len(toks)
                    if e:
                        steps, tokens = steps + 1, tokens + len(toks)
        drafter.finish()
    return tokens / steps, steps


def window_trie(window: np.ndarray, tail: list[int], depth: int, nodes: int) -> set:
    """The ``tree`` rule in a window: the trie of the ``nodes`` continuations (up to ``depth``)
    that most of the first ``VOTERS`` occurrences of the longest suffix of ``tail`` go on with
    (ties: the shallower, then the earlier occurrence)."""
    D, found = len(window), []
    for n in range(len(tail), 0, -1):
        key = tail[len(tail) - n :]
        if min(key) < 0:
            continue
        found = [i for i in range(n, D) if window[i] >= 0 and window[i - n : i].tolist() == key]
        if found:
            break
    counts, first = collections.Counter(), {}
    for o, i in enumerate(found[:VOTERS]):
        cont = window[i : i + depth].tolist()
        cont = cont[: cont.index(-1)] if -1 in cont else cont
        for j in range(1, len(cont) + 1):
            counts[tuple(cont[:j])] += 1
            first.setdefault(tuple(cont[:j]), o)
    return set(sorted(counts, key=lambda path: (-counts[path], len(path), first[path]))[:nodes])


def _tail(prompt: list[int], response: list[int], at: int) -> list[int]:
    """The last ``MAX_NGRAM`` tokens of the prompt and the response's first ``at`` (-1 before a
    shorter text)."""
    before = response[max(0, at - MAX_NGRAM) : at]
    return ([-1] * MAX_NGRAM + prompt[-MAX_NGRAM:] + before)[-MAX_NGRAM:]


def _row(rule: str, label: str, per_step: float, steps: int) -> None:
    print(f"{rule:>10} {label:>26} | {per_step:.2f} ({steps} verify steps)", flush=True)


def replay_windows(prompts, epochs, n: int, k: int, chunk: int, nodes: int = 0):
    """Tokens per verify step over epochs 1 onwards when drafts come from the engine's windows,
    renewed every ``chunk`` verify steps: its voted line of ``k`` (``nodes = 0``) or a trie of
    ``nodes`` up to ``k`` deep."""
    drafter = Drafter(k)
    lookup = jax.jit(lookup_drafts, static_argnums=2)
    steps = tokens = 0
    for e, rows in enumerate(epochs):
        drafter.begin([np.asarray(p) for p in prompts], n)
        at = [0] * len(rows)
        while live := [r for r in range(len(rows)) if at[r] < len(rows[r])]:
            size = drafter.window_size(chunk)
            windows = np.stack([drafter.window(r, size)[0] for r in live])
            begin = {r: at[r] for r in live}  # the host's texts grow at the chunk's end
            for _ in range(chunk):
                going = [i for i, r in enumerate(live) if at[r] < len(rows[r])]
                if not going:
                    break
                tails = np.asarray([_tail(prompts[r // n], rows[r], at[r]) for r in live])
                if not nodes:
                    drafts, length, _ = map(np.asarray, lookup(windows, tails, k))
                for i in going:
                    r = live[i]
                    if nodes:
                        trie = window_trie(windows[i], tails[i].tolist(), k, nodes)
                    else:
                        line = drafts[i, : length[i]].tolist()
                        trie = {tuple(line[:j]) for j in range(1, len(line) + 1)}
                    future = rows[r][at[r] :]
                    taken = 1
                    while taken < len(future) and tuple(future[:taken]) in trie:
                        taken += 1
                    at[r] += taken
                    if e:
                        steps, tokens = steps + 1, tokens + taken
            for r in live:
                drafter.extend(r, rows[r][begin[r] : at[r]])
        drafter.finish()
    return tokens / steps, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--epochs", type=int, default=4, help="the first fills the history")
    ap.add_argument("--k", type=int, default=4, help="drafted tokens per verify step")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--rules", default=",".join(RULES), help="which to replay")
    ap.add_argument("--tree-nodes", default="4,8,16,32", help="drafted tokens of the tree rule")
    ap.add_argument("--tree-depth", default="4,8", help="the tree rule's deepest drafts")
    ap.add_argument("--chunk", type=int, default=16, help="verify steps per window (window)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config")
    args = ap.parse_args()
    if args.epochs < 2:
        ap.error("--epochs must be >= 2 (the first is not measured)")
    print(f"{CONFIG} {' '.join(args.set)}: {args.prompts} prompts x {args.n} samples, k={args.k}, "
          f"temperature {args.temperature}, up to {args.max_new} new tokens")  # fmt: skip
    rules = args.rules.split(",")
    if set(rules) - set(RULES):
        ap.error(f"--rules: one of {', '.join(RULES)}")
    prompts, epochs = record(args)
    lengths = [len(r) for rows in epochs[1:] for r in rows]
    print(f"responses: {np.mean(lengths):.1f} tokens on average (epochs 1-{args.epochs - 1})")
    runs = [
        ("first", ("siblings", "history")),
        ("frequent", ("siblings", "history")),
        ("frequent", ("siblings",)),
        ("frequent", ("history",)),
        ("best-match", ("siblings", "history")),
    ]
    if set(rules) - {"tree", "window"}:
        print(f"\n{'rule':>10} {'sources':>26} | tokens per verify step")
    for rule, sources in (run for run in runs if run[0] in rules):
        per_step, steps = replay(prompts, epochs, args.n, args.k, rule, sources)
        names = "self, " + ", ".join(sources)
        _row(rule, names, per_step, steps)
    if "tree" in rules:
        print(f"\n{'rule':>10} {'nodes x depth':>26} | tokens per verify step (all sources)")
        for depth in map(int, args.tree_depth.split(",")):
            for nodes in map(int, args.tree_nodes.split(",")):
                per_step, steps = replay(prompts, epochs, args.n, depth, "tree", nodes=nodes)
                _row("tree", f"{nodes} x {depth}", per_step, steps)
    if "window" in rules:
        print(f"\n{'rule':>10} {'drafts':>26} | tokens per verify step (engine windows, "
              f"renewed every {args.chunk} steps)")  # fmt: skip
        per_step, steps = replay_windows(prompts, epochs, args.n, args.k, args.chunk)
        _row("window", f"line of {args.k}, voted", per_step, steps)
        for depth in map(int, args.tree_depth.split(",")):
            for nodes in map(int, args.tree_nodes.split(",")):
                per_step, steps = replay_windows(prompts, epochs, args.n, depth, args.chunk, nodes)
                _row("window", f"trie {nodes} x {depth}", per_step, steps)


if __name__ == "__main__":
    main()
