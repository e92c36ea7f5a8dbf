"""The update on packed and padded rows: equivalence, micro/mini-batching, skipping, compiles,
and multi-turn rollouts whose observation tokens carry no loss.

Every batch here is built by the trainer's own stages (``Updater.prepare`` / ``.update``) from
one synthetic rollout held on device (or the same rollout made multi-turn), so packed and padded
runs see the very same sequences.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from delta_jax import sharding as sh
from delta_jax.config import load_config
from delta_jax.models import ModelConfig, Transformer, lora, token_logprobs
from delta_jax.rl.packing import first_fit_decreasing, make_assemble, plan_rows
from delta_jax.rl.rollout import Rollout
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.rl.train_step import check_batch, loss_segments, window_logprobs, window_loss
from delta_jax.rl.update import Updater
from delta_jax.rl.update_plan import UpdatePlan

P, G, PROMPTS, N = 6, 10, 4, 4
B = PROMPTS * N
# Plain SGD with lr 1: the parameter change *is* the accumulated gradient, so comparing
# parameters compares gradients. (Adam's first step is ~lr*sign(g) per coordinate, which turns
# float32 rounding in near-zero gradient entries into lr-sized differences.)
SGD = optax.sgd(1.0)


def _build_setup(dtype=jnp.float32, lora_rank=0):
    """The tiny policy in ``dtype`` (with LoRA adapters of ``lora_rank``) and one synthetic
    rollout sampled from it (its log-probs and hidden states, as the sampler hands them over)."""

    def make():
        model = Transformer(
            ModelConfig.tiny("qwen3"), dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)
        )
        if lora_rank:
            lora.add_adapters(model, rank=lora_rank, alpha=2.0 * lora_rank, seed=1)
        return model

    # Initialisation and forward jitted: one compile each instead of one per eager op.
    graphdef = nnx.split(nnx.eval_shape(make), nnx.Param)[0]
    params = jax.jit(lambda: nnx.split(make(), nnx.Param)[1])()
    rng = np.random.default_rng(0)
    plens = rng.integers(2, P + 1, PROMPTS).astype(np.int32).repeat(N)  # groups of N samples
    glens = rng.integers(1, G + 1, B).astype(np.int32)
    seqs = np.zeros((B, P + G), np.int32)
    for i in range(B):
        if i % N == 0:
            prompt = rng.integers(3, 256, plens[i])
        seqs[i, P - plens[i] : P] = prompt
        seqs[i, P : P + glens[i]] = rng.integers(3, 256, glens[i])
    # The sampler's view: log-probs and hidden states of the response tokens, padded layout.
    out = jax.jit(
        lambda params, seqs: token_logprobs(
            nnx.merge(graphdef, params),
            seqs[:, :-1],
            seqs[:, 1:],
            attention_mask=seqs[:, :-1] != 0,
            return_hidden=True,
            score_from=P - 1,
        )
    )(params, jnp.asarray(seqs))
    resp = np.arange(G)[None] < glens[:, None]
    rewards = rng.normal(size=B).astype(dtype)
    rewards[4:8] = 1.0  # one group without signal: zero advantages, as GRPO gives
    advantages = (rewards - rewards.reshape(-1, N).mean(1).repeat(N)).astype(dtype)
    rollout = Rollout(
        sequences=jnp.asarray(seqs),
        rollout_logprobs=jnp.where(resp, out.logprobs, 0.0),
        hidden=out.hidden,
        prompt_lengths=plens,
        lengths=glens,
        rewards=rewards,
        advantages=advantages,
        records=[],
        responses=[],
        stats={},
    )
    return graphdef, params, rollout


def _observations(lengths):
    """bool ``[B, G]``: observation spans (tokens a tool wrote) inside the responses: between
    two turns of the policy, or at the end of a response the turn limit cut."""
    obs = np.zeros((B, G), bool)
    for i, g in enumerate(lengths):
        if g >= 4 and i % 3 != 2:
            obs[i, g // 3 : 2 * (g // 3)] = True
        elif g >= 3:
            obs[i, g - 2 : g] = True
    return obs


def _multi_turn(rollout):
    """The rollout as a multi-turn one: the same tokens, some of them observations. The sampler
    drew no observation, so its log-probs there are NaN (they must never be read); the action
    mask is True on padding (only the columns before the length are read)."""
    obs = _observations(rollout.lengths)
    return dataclasses.replace(
        rollout,
        rollout_logprobs=jnp.where(obs, jnp.nan, rollout.rollout_logprobs),
        action_mask=jnp.asarray(~obs),
    )


@pytest.fixture(scope="module")
def setup():
    return _build_setup()


@pytest.fixture(scope="module")
def setup_multi(setup):
    graphdef, params, rollout = setup
    return graphdef, params, _multi_turn(rollout)


@pytest.fixture(scope="module")
def setup64():
    """The same in float64 (x64 on while it is built and used only)."""
    with jax.enable_x64(True):
        return _build_setup(jnp.float64)


def _plan(loss="delta", packing=True, mini=1, micro=1, **algo):
    overrides = [
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.samples_per_prompt={N}",
        f"rollout.max_new_tokens={G}",
        f"data.max_prompt_length={P}",
        f"algo.loss={loss}",
        f"algo.packing={str(packing).lower()}",
        f"algo.mini_batches={mini}",
        "algo.tokens_per_row=30",  # two of the longest sequences: packing has room to work
        f"algo.micro_batches={micro}",
        *(f"algo.{k}={v}" for k, v in algo.items()),
    ]
    return load_config(None, overrides), UpdatePlan.from_config(load_config(None, overrides))


def _mesh():
    """The one-device mesh of these tests; updates run under it, as the loop runs them."""
    return sh.make_mesh(1, 1, 1, devices=jax.devices()[:1])


def _initial_state(params, optimizer):
    """A fresh train state on device 0, placed as the update's outputs are (committed), so the
    update compiles once for the first and the later calls."""
    return jax.device_put(init_train_state(jax.tree.map(jnp.copy, params), optimizer),
                          jax.devices()[0])  # fmt: skip


def _rl_update(setup, config, plan, optimizer=SGD, updater=None):
    """One full RL update (prepare + every mini-batch update) through the loop's stages, by
    ``updater`` (default: a new one of ``plan``: its programs compiled afresh)."""
    graphdef, params, rollout = setup
    if updater is None:
        updater = Updater(graphdef, optimizer, plan, _mesh(), seed=config.run.seed, donate=False)
    ref_params = jax.tree.map(jnp.copy, params) if plan.reference else None
    batch, metrics = updater.prepare(rollout, 1, params, ref_params)
    state, update_metrics = updater.update(_initial_state(params, optimizer), batch)
    return state, {**metrics, **update_metrics}, batch, updater.train_step


def cached_updates(setup, setup_multi):
    """``updates(cfg, plan, multi_turn)``: one full RL update of ``setup``'s rollout (or of
    ``setup_multi``'s), each run once, with one :class:`Updater` per plan (the single- and
    multi-turn rollouts have the same shapes of rows: one compiled update serves both)."""
    cache, updaters = {}, {}

    def run(cfg, plan, multi_turn=False):
        if plan not in updaters:
            updaters[plan] = Updater(setup[0], SGD, plan, _mesh(), seed=cfg.run.seed, donate=False)
        if (plan, multi_turn) not in cache:
            rollout = setup_multi if multi_turn else setup
            cache[plan, multi_turn] = _rl_update(rollout, cfg, plan, updater=updaters[plan])
        return cache[plan, multi_turn]

    return run


@pytest.fixture(scope="module")
def results(setup, setup_multi):
    """``results(loss, packing, mini, micro, multi_turn=False, **algo)``: one full RL update (SGD
    lr 1) of the rollout (or of its multi-turn form), each run once; ``results.train_step(...)``
    (same arguments): the jitted update it ran.

    One :class:`Updater` per plan (equal plans, e.g. a default spelled out, are one): the
    single- and multi-turn rollouts have the same lengths, so the same shapes of rows, and
    their updates run the same compiled programs, as a run's steps do (the tests that replay
    an update check its train step compiled once)."""
    updates = cached_updates(setup, setup_multi)

    def run(loss="delta", packing=True, mini=1, micro=1, multi_turn=False, **algo):
        return updates(*_plan(loss, packing, mini, micro, **algo), multi_turn)

    def get(*args, **kwargs):
        return run(*args, **kwargs)[:3]

    get.train_step = lambda *args, **kwargs: run(*args, **kwargs)[3]
    return get


def _max_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# (mini-batches, micro-batches, packed rows per micro-batch): a step's rows in one micro-batch
# (bucketed), or micro-batches of 2 rows, as many as the rows need (one shape per run; DelTA's
# coefficients then from the sampler's hidden states, here the trainer's own).
CASES = [(1, 1, "bucketed"), (1, 4, "bucketed"), (4, 1, "bucketed"), (1, 1, 2), (4, 1, 2)]


@pytest.mark.parametrize("share", [False, True])
def test_packed_rows_score_only_response_positions(setup, share):
    """Packed rows list exactly the positions that predict a response token, first in a window
    as wide as a row (one width whatever the lengths; the empty slots last, the LM head's
    chunks of them skipped): the targets there are every sequence's response tokens, in order,
    and nothing else."""
    _, _, rollout = setup
    _, plan = _plan("dapo", packing=True, share_prompts=str(share).lower())
    index, stats = plan_rows(plan, np.arange(B), rollout.prompt_lengths, rollout.lengths, 1)
    logprobs, advantages = rollout.rollout_logprobs, jnp.asarray(rollout.advantages)
    batch = make_assemble(plan)(rollout.sequences, logprobs, advantages, None, None, index)
    slots, src = np.asarray(batch.score_positions), np.asarray(index.score_source)
    targets = np.asarray(batch.targets)  # each slot's
    assert slots.shape[-1] == plan.row_len
    used = (slots >= 0).sum(-1)
    assert stats["batch/scored_positions"] == used.max() * stats["batch/packed_rows"]
    # Each row's slots come first, its empty ones after them.
    rows = slots.reshape(-1, plan.row_len)
    assert all((row[:n] >= 0).all() for row, n in zip(rows, used.flat, strict=True))
    assert stats["batch/shared_prompts"] == share
    scored = {}
    for row in np.ndindex(slots.shape[:-1]):
        for k in np.flatnonzero(slots[row] >= 0):
            scored.setdefault(int(src[row][k]), []).append(int(targets[row][k]))
    seqs = np.asarray(rollout.sequences)
    assert scored == {s: seqs[s, P : P + g].tolist() for s, g in enumerate(rollout.lengths)}
    assert int(np.asarray(batch.loss_mask).sum()) == int(rollout.lengths.sum())


def _assembled(rollout, plan, coefficients=None, action_mask=None):
    """The rollout's rows (one mini-batch, in rollout order) and their layout."""
    index, _ = plan_rows(plan, np.arange(B), rollout.prompt_lengths, rollout.lengths, 1)
    batch = make_assemble(plan)(
        rollout.sequences, rollout.rollout_logprobs, jnp.asarray(rollout.advantages),
        coefficients, action_mask, index,
    )  # fmt: skip
    return batch, index


def _window_targets(plan, index, score_positions):
    """For each window slot: the rollout sequence, the response column ``t`` of its target, and
    whether that target is a response token (NumPy, from the layout alone)."""
    if plan.packing:  # the layout lists what each slot predicts
        slot = np.asarray(score_positions) >= 0
        t = np.asarray(index.score_column) + 1 - P
        response = slot & (np.asarray(index.score_segment) > 0) & (t >= 0)
        return np.asarray(index.score_source), t, response
    window = plan.score_from + np.arange(plan.window)
    positions = np.broadcast_to(window, (*index.source.shape[:-1], plan.window))
    take = lambda x: np.take_along_axis(np.asarray(x), positions, -1)
    t = take(index.column) + 1 - P
    return take(index.source), t, (take(index.segment_ids) > 0) & (t >= 0)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_no_action_mask_means_every_response_token(setup, packing):
    """Single-turn: no action mask assembles bit for bit what an all-True one does (whether or
    not it is True on padding), coefficients included."""
    _, _, rollout = setup
    _, plan = _plan("delta", packing=packing)
    coefficients = jnp.asarray(np.random.default_rng(1).uniform(0.8, 1.2, (B, G)), jnp.float32)
    within = jnp.arange(G)[None] < jnp.asarray(rollout.lengths)[:, None]
    want, _ = _assembled(rollout, plan, coefficients, None)
    same = lambda a, b: (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b))
    for actions in (jnp.ones((B, G), bool), within):
        got, _ = _assembled(rollout, plan, coefficients, actions)
        for field in dataclasses.fields(want):
            assert same(getattr(want, field.name), getattr(got, field.name)), field.name
    assert int(np.asarray(want.loss_mask).sum()) == int(rollout.lengths.sum())


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_loss_mask_is_the_tokens_the_policy_drew(setup_multi, packing):
    """Multi-turn: the loss-masked targets are exactly each response's action tokens, in order;
    advantages, sampler log-probs and coefficients are read there only (the NaN log-probs of the
    observations never reach the batch)."""
    _, _, rollout = setup_multi
    _, plan = _plan("delta", packing=packing)
    batch, index = _assembled(rollout, plan, jnp.ones((B, G)), rollout.action_mask)
    source, t, response = _window_targets(plan, index, batch.score_positions)
    actions = np.asarray(rollout.action_mask)
    mask = np.asarray(batch.loss_mask)
    assert np.array_equal(mask, response & actions[source, np.clip(t, 0, G - 1)])
    assert mask.sum() == rollout.lengths.sum() - _observations(rollout.lengths).sum()
    if plan.packing:
        targets = np.asarray(batch.targets)  # each slot's
    else:
        targets = np.asarray(batch.targets)[..., plan.score_from :]
    seqs = np.asarray(rollout.sequences)
    for s, g in enumerate(rollout.lengths):  # row-major: each sequence's tokens in order
        assert targets[mask & (source == s)].tolist() == seqs[s, P : P + g][actions[s, :g]].tolist()
    lp = np.asarray(batch.rollout_logprobs)
    assert np.isfinite(lp).all() and np.all(lp[~mask] == 0) and np.all(lp[mask] != 0)
    assert np.all(np.asarray(batch.advantages)[~mask] == 0)
    assert np.array_equal(np.asarray(batch.coefficients) != 0, mask)


OBJECTIVES = {
    "delta": ("delta", {}),
    "dapo": ("dapo", {}),
    "grpo": ("grpo", {}),
    "gspo": ("gspo", {}),
    "dapo_kl_entropy": ("dapo", {"kl_coef": 0.1, "entropy_coef": 0.01}),
    "forking_tokens": ("dapo_forking_tokens", {}),
}


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_observations_get_no_gradient(setup_multi, name):
    """The train step's loss of a multi-turn batch, as a function of the window's log-probs (and
    entropy): its gradient at the observation positions is exactly 0 — no surrogate, normaliser,
    KL, entropy bonus, DelTA statistic or forking-token rank reads them — and not 0 everywhere
    at the actions. The batch is the trainer's (``Updater.prepare``; DelTA's coefficients in the
    loss, GRPO/GSPO per response of the packed rows, the KL against a reference pass)."""
    graphdef, params, rollout = setup_multi
    loss, algo = OBJECTIVES[name]
    config, plan = _plan(loss, **algo)
    updater = Updater(graphdef, SGD, plan, _mesh(), seed=config.run.seed, donate=False)
    batch, _ = updater.prepare(rollout, 1, params, params if plan.reference else None)
    mb = jax.tree.map(lambda x: x[0, 0], batch)  # the one mini- and micro-batch
    logp, entropy, hidden = jax.jit(
        lambda params, mb: window_logprobs(
            nnx.merge(graphdef, params), mb, plan, entropy=plan.objective.needs_entropy,
            hidden=plan.coefficients == "in_loss",
        )
    )(params, mb)  # fmt: skip
    normalizer = plan.objective.count(mb.loss_mask, loss_segments(plan, mb))
    value = lambda lp, ent: window_loss(plan, None, mb, lp, ent, hidden, normalizer)
    wrt = (0, 1) if plan.objective.entropy_coef else (0,)  # entropy bonus
    (_, metrics), grads = jax.jit(jax.value_and_grad(value, wrt, has_aux=True))(logp, entropy)
    # The observations' window slots, from the layout and the rollout alone.
    index, _ = plan_rows(plan, np.arange(B), rollout.prompt_lengths, rollout.lengths, 1)
    source, t, response = _window_targets(plan, index, batch.score_positions)
    actions = np.asarray(rollout.action_mask)[source, np.clip(t, 0, G - 1)]
    observations, mask = (response & ~actions)[0, 0], np.asarray(mb.loss_mask)
    assert observations.sum() == _observations(rollout.lengths).sum()
    for grad in map(np.asarray, grads):
        assert np.all(grad[observations] == 0.0)
        assert np.abs(grad[mask]).max() > 0
    assert float(metrics["tokens"]) == mask.sum() == (response & actions).sum()


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single_turn", "multi_turn"])
@pytest.mark.parametrize("mini,micro,rows", CASES)
@pytest.mark.parametrize("loss", ["delta", "dapo"])
def test_packed_update_equals_padded(setup, results, loss, mini, micro, rows, multi_turn):
    """Same rollout, packed vs padded rows: same parameters, coefficients, loss and metrics;
    also when it is multi-turn (observation tokens inside some responses, no loss on them).

    With 4 mini-batches the full RL update is four SGD steps of lr 1, each taken where the
    previous one left the parameters, and the fourth is badly conditioned (gradient norm ~7, 30%
    of the tokens at the PPO clip): in float32 the two chains' end points differ by rounding
    amplified by the steps, not by layout (DelTA 2.6e-6, DAPO 2.7e-5 on this rollout; on one
    differing from it by float32 ulps, DelTA 2.7e-5, DAPO 4.9e-6) — in float64 they agree
    (:func:`test_packed_chained_updates_equal_padded_in_float64`). In float32 what the layout
    must not change is each update: the packed run's updates are replayed one at a time, the
    padded update applied to the very parameters the packed one started from, at lr 1 within
    1e-5 (at most 7.5e-7 DelTA, 3.6e-7 DAPO); the replay ends exactly at the full update's
    parameters.
    """
    _, params, _ = setup
    packed = results(loss, True, mini, micro, multi_turn, micro_batch_rows=rows)
    padded = results(loss, False, mini, micro, multi_turn)
    # Every micro-batch of the plan (those of padding only skipped), the window a row wide.
    shape = (micro, B // mini) if rows == "bucketed" else (B // mini // rows, rows)
    assert packed[2].tokens.shape[1] == shape[0] and packed[2].targets.shape[-1] == 30
    assert rows == "bucketed" or packed[2].tokens.shape[2] == shape[1]
    if mini == 1:
        assert _max_diff(packed[0].params, padded[0].params) <= 1e-5
    else:
        step_packed = results.train_step(loss, True, mini, micro, multi_turn, micro_batch_rows=rows)
        step_padded = results.train_step(loss, False, mini, micro, multi_turn)
        state = _initial_state(params, SGD)
        for m in range(mini):
            take = lambda batch, m=m: jax.tree.map(lambda x: x[m], batch)
            with sh.use_mesh(_mesh()):
                after_padded, _ = step_padded(state, take(padded[2]))
                state, _ = step_packed(state, take(packed[2]))
            assert _max_diff(state.params, after_padded.params) <= 1e-5, f"update {m}"
        assert _max_diff(state.params, packed[0].params) == 0.0
        # The replay ran the full update's own compiled programs (no recompilation).
        assert step_packed._cache_size() == 1 and step_padded._cache_size() == 1
    _assert_same_update(params, packed, padded)
    if multi_turn:  # the observations were left out: another update than the single-turn one
        lengths = setup[2].lengths
        actions = 1 - _observations(lengths).sum() / lengths.sum()
        assert packed[1]["batch/action_fraction"] == pytest.approx(actions, rel=1e-6)
        single_turn = results(loss, True, mini, micro, micro_batch_rows=rows)[0]
        assert _max_diff(packed[0].params, single_turn.params) > 1e-3
    else:
        assert "batch/action_fraction" not in packed[1]


@pytest.mark.parametrize("loss", ["delta", "dapo"])
def test_packed_chained_updates_equal_padded_in_float64(setup64, loss):
    """The full RL update of 4 mini-batches (4 chained SGD steps of lr 1), model, DelTA and loss
    in float64: packed and padded rows end at the same parameters within 1e-5 (measured: DelTA
    2.7e-15, DAPO 8.8e-15), so the float32 gap of the chain is rounding amplified by the steps,
    not layout."""
    with jax.enable_x64(True):  # this test only: every array and program below is float64
        plans = (_plan(loss, p, 4, 1, micro_batch_rows=2) for p in (True, False))
        packed, padded = (_rl_update(setup64, *plan) for plan in plans)
        assert jax.tree.leaves(packed[0].params)[0].dtype == jnp.float64
        assert packed[2].old_logprobs.dtype == jnp.float64
        assert _max_diff(packed[0].params, padded[0].params) <= 1e-5
        _assert_same_update(setup64[1], packed, padded)


def _assert_same_update(params, packed, padded):
    """Fewer rows packed; the update moved the parameters; the same loss, metrics and DelTA
    coefficients (token by token) in both layouts."""
    (state, m_packed, b_packed), (_, m_padded, b_padded) = packed[:3], padded[:3]
    assert m_packed["batch/packed_rows"] < m_padded["batch/packed_rows"]
    assert m_packed["batch/pad_fraction"] <= m_padded["batch/pad_fraction"]
    assert _max_diff(state.params, params) > 1e-2
    # (where the coefficients were computed aside: in the loss, or from the sampler's hidden)
    same = lambda k: not k.startswith(("batch/", "time/", "delta/computed_"))
    assert {k for k in m_packed if same(k)} == {k for k in m_padded if same(k)}
    for key in filter(same, m_padded):
        np.testing.assert_allclose(m_packed[key], m_padded[key], rtol=1e-5, atol=1e-6, err_msg=key)
    if b_padded.coefficients is not None:  # fixed coefficients: compare token by token
        coef = lambda b: _coefficients_by_token(b)
        np.testing.assert_allclose(coef(b_packed), coef(b_padded), rtol=0, atol=1e-6)


def _coefficients_by_token(batch):
    """Coefficients keyed by (advantage, rollout log-prob, target token): layout-free."""
    mask = np.asarray(batch.loss_mask)
    keys = np.stack(
        [
            np.asarray(batch.advantages)[mask],
            np.asarray(batch.rollout_logprobs)[mask],
        ],
        axis=1,
    )
    order = np.lexsort(keys.T[::-1])
    return np.asarray(batch.coefficients)[mask][order]


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "gspo"])
def test_packed_micro_batches_are_exact_for_every_objective(results, loss):
    """Sequence-level aggregations and GSPO's sequence ratio see responses, not rows."""
    s4, m4, _ = results(loss, True, 1, 4)
    s1, m1, _ = results(loss, False, 1, 1)
    assert abs(m1["loss"] - m4["loss"]) <= 1e-5
    assert _max_diff(s1.params, s4.params) <= 1e-5


def test_delta_with_unit_range_equals_dapo(results):
    s_delta, m_delta, _ = results("delta", lam_min=1.0, lam_max=1.0)
    s_dapo, m_dapo, _ = results("dapo")
    assert abs(m_delta["loss"] - m_dapo["loss"]) <= 1e-6
    assert _max_diff(s_delta.params, s_dapo.params) <= 1e-6


def test_delta_changes_the_update(results):
    """With the default range the coefficients are not all one, so the update differs from DAPO."""
    s_delta, m_delta, _ = results("delta")
    s_dapo, _, _ = results("dapo")
    assert m_delta["coef_std"] > 1e-3 and m_delta["delta/gamma_pos"] > 0
    assert _max_diff(s_delta.params, s_dapo.params) > 1e-6


def test_non_finite_gradient_skips_the_update_and_the_step_compiles_once(setup):
    graphdef, params, rollout = setup
    cfg, plan = _plan("dapo")
    bad = dataclasses.replace(rollout, advantages=rollout.advantages.copy())
    bad.advantages[0] = np.nan
    optimizer = make_optimizer(cfg.optim, 10)
    state, metrics, _, step = _rl_update((graphdef, params, bad), cfg, plan, optimizer)
    assert metrics["update_skipped"] == 1.0
    assert int(state.skipped) == 1 and int(state.step) == 0
    assert _max_diff(state.params, params) == 0.0
    # The skipped update and the next three run one compiled program.
    batch, _ = Updater(graphdef, optimizer, plan, _mesh()).prepare(rollout, 1, state.params)
    for _ in range(3):
        with sh.use_mesh(_mesh()):
            state, metrics = step(state, jax.tree.map(lambda x: x[0], batch))
    assert float(metrics["update_skipped"]) == 0.0 and int(state.step) == 3
    assert step._cache_size() == 1


def test_the_plan_decides_the_inputs(results):
    """A batch without the coefficients the plan expects is refused (no None-means-a-mode)."""
    _, sampler_plan = _plan("delta", micro=4, micro_batch_rows="bucketed")
    _, in_loss_plan = _plan("delta", micro_batch_rows="bucketed")
    assert (sampler_plan.coefficients, in_loss_plan.coefficients) == ("sampler", "in_loss")
    # One shape per run: several micro-batches of packed rows unless one holds every row.
    assert _plan("delta", micro_batch_rows=8)[1].coefficients == "sampler"
    assert _plan("delta", micro_batch_rows=B)[1].coefficients == "in_loss"
    assert _plan("delta", packing=False)[1].coefficients == "in_loss"
    assert _plan("delta", mini=2)[1].coefficients == "old_pass"
    assert _plan("dapo", mini=2)[1].coefficients == "none"
    _, _, batch = results("delta", micro_batch_rows="bucketed")
    with pytest.raises(ValueError, match="needs TrainBatch.coefficients"):
        check_batch(sampler_plan, batch)


def test_first_fit_decreasing_fills_rows_longest_first():
    bins = first_fit_decreasing([5, 9, 2, 7, 3, 4], capacity=10)
    # 9 opens a row, 7 another, 5 a third; 4 joins the 5, 3 the 7; 2 fits nowhere any more.
    assert bins == [[1], [3, 4], [0, 5], [2]]
    lengths = [5, 9, 2, 7, 3, 4]
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    with pytest.raises(ValueError, match="> row of 10"):
        first_fit_decreasing([11], capacity=10)


def test_an_empty_response_carries_no_loss_in_padded_rows(setup):
    """Padded rows keep a sequence whose response is empty: its prompt but the last token, so
    no position predicts a (padding) response token."""
    _, _, rollout = setup
    lengths = rollout.lengths.copy()
    lengths[3] = 0
    empty = dataclasses.replace(rollout, lengths=lengths)
    _, plan = _plan("dapo", packing=False)
    batch, index = _assembled(empty, plan)
    source, _, _ = _window_targets(plan, index, batch.score_positions)
    mask = np.asarray(batch.loss_mask)
    assert not mask[source == 3].any()
    assert mask.sum() == lengths.sum()
    real = (np.asarray(index.source) == 3) & (np.asarray(index.segment_ids) > 0)
    assert real.sum() == rollout.prompt_lengths[3] - 1
