"""Shared prompts (``algo.share_prompts``): packed rows hold each prompt once for several of its
responses, and the update is the unshared one's: the layout's mask against a brute-force one,
log-probs, DelTA's coefficients, the loss and the parameter gradients against unshared packed
rows (float32 within stated tolerances, float64 to 1e-9), single- and multi-turn, micro- and
mini-batches, and a group split over rows.

The rollout is ``tests.rl.test_train_step``'s: groups of ``N`` samples share a prompt.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax import sharding as sh
from delta_jax.config import ConfigError, load_config
from delta_jax.models.attention import visible
from delta_jax.rl.packing import plan_rows, uniform_rows
from delta_jax.rl.state import init_sharded_state
from delta_jax.rl.update import Updater
from tests.rl.test_train_step import (
    CASES,
    SGD,
    B,
    N,
    P,
    _build_setup,
    _initial_state,
    _max_diff,
    _multi_turn,
    _plan,
    _rl_update,
    cached_updates,
)


@pytest.fixture(scope="module")
def setup():
    return _build_setup()


@pytest.fixture(scope="module")
def update(setup):
    """``update(share, loss, mini, micro, multi_turn, **algo)``: one full RL update, cached.
    One :class:`Updater` per plan: the single- and multi-turn rollouts (same lengths, same
    shapes of rows) run its compiled programs (``tests.rl.test_train_step``'s ``results``)."""
    updates = cached_updates(setup, (setup[0], setup[1], _multi_turn(setup[2])))

    def run(share, loss="delta", mini=1, micro=1, multi_turn=False, **algo):
        plan = _plan(loss, True, mini, micro, share_prompts=share, **algo)
        return updates(*plan, multi_turn)

    return run


def _brute_force_visible(src, col, real):
    """bool ``[rows, T, T]`` from what each position holds (its sequence and column) alone: a
    real query sees the earlier real positions of its own sequence, and its group's prompt."""
    T = src.shape[-1]
    group = src // N
    causal = np.tril(np.ones((T, T), bool))
    own = src[..., :, None] == src[..., None, :]
    prompt = (col[..., None, :] < P) & (group[..., :, None] == group[..., None, :])
    return causal & real[..., :, None] & real[..., None, :] & (own | prompt)


def test_the_layout_mask_and_positions_are_the_unshared_ones(setup):
    _, _, rollout = setup
    _, plan = _plan("delta", True, share_prompts=True)
    index, stats = plan_rows(plan, np.arange(B), rollout.prompt_lengths, rollout.lengths, 1)
    flat = lambda x: np.asarray(x).reshape(-1, x.shape[-1])
    seg, parent = flat(index.segment_ids), flat(index.parent_ids)
    got = np.asarray(visible(jnp.asarray(seg), jnp.asarray(parent)))
    real = seg > 0
    src, col = flat(index.source), flat(index.column)
    assert np.array_equal(got & real[:, :, None], _brute_force_visible(src, col, real))
    # Each token at its unshared rotary position: its index in prompt ++ response.
    unshared = col - (P - rollout.prompt_lengths[src])
    assert np.array_equal(np.where(real, flat(index.positions), 0), np.where(real, unshared, 0))
    # Fewer positions than the unshared rows: each group's prompt once per row it is in.
    _, unshared_plan = _plan("delta", True, share_prompts=False)
    _, before = plan_rows(unshared_plan, np.arange(B), rollout.prompt_lengths, rollout.lengths, 1)
    assert stats["batch/positions"] < before["batch/positions"]
    copies = _prompt_copies(index)
    saved = sum(rollout.prompt_lengths[g * N] * (N - copies[g]) for g in range(B // N))
    assert before["batch/positions"] - stats["batch/positions"] == saved


def _prompt_copies(index) -> dict[int, int]:
    """Group -> the rows its prompt is laid out in."""
    fields = (index.source, index.column, index.segment_ids)
    src, col, seg = (np.asarray(x).reshape(-1, x.shape[-1]) for x in fields)
    prompt = (col < P) & (seg > 0)
    pairs = {(r, int(s) // N) for r in range(src.shape[0]) for s in src[r][prompt[r]]}
    return {g: sum(1 for _, h in pairs if h == g) for g in range(B // N)}


def _assert_same(a, b, atol):
    """Same parameters (SGD lr 1: the same gradient), loss, metrics and coefficients."""
    (state_a, m_a, batch_a), (state_b, m_b, batch_b) = a[:3], b[:3]
    assert _max_diff(state_a.params, state_b.params) <= atol
    same = lambda k: not k.startswith(("batch/", "time/"))
    assert {k for k in m_a if same(k)} == {k for k in m_b if same(k)}
    for key in filter(same, m_a):
        np.testing.assert_allclose(m_a[key], m_b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    if batch_a.coefficients is not None:  # fixed coefficients: compare slot by slot
        mask = lambda b: np.asarray(b.loss_mask)
        key = lambda b: np.lexsort(
            [np.asarray(b.rollout_logprobs)[mask(b)], np.asarray(b.advantages)[mask(b)]]
        )
        coef = lambda b: np.asarray(b.coefficients)[mask(b)][key(b)]
        np.testing.assert_allclose(coef(batch_a), coef(batch_b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single_turn", "multi_turn"])
@pytest.mark.parametrize("mini,micro,rows", CASES)
@pytest.mark.parametrize("loss", ["delta", "gspo"])
def test_shared_update_equals_unshared(setup, update, loss, mini, micro, rows, multi_turn):
    """The same rollout, prompts shared or not: the same update. With 4 mini-batches the chain
    of four SGD steps amplifies float32 rounding (as packed vs padded rows,
    ``test_packed_update_equals_padded``): there each update is replayed from the shared run's
    parameters, within 1e-5; float64 below."""
    shared, unshared = (
        update(s, loss, mini, micro, multi_turn, micro_batch_rows=rows) for s in (True, False)
    )
    assert shared[1]["batch/positions"] < unshared[1]["batch/positions"]
    if mini == 1:
        _assert_same(shared, unshared, atol=1e-5)
        return
    state = _initial_state(setup[1], SGD)
    for m in range(mini):
        take = lambda batch, m=m: jax.tree.map(lambda x: x[m], batch)
        with sh.use_mesh(sh.make_mesh(1, 1, 1, devices=jax.devices()[:1])):
            after_unshared, _ = unshared[3](state, take(unshared[2]))
            state, _ = shared[3](state, take(shared[2]))
        assert _max_diff(state.params, after_unshared.params) <= 1e-5, f"update {m}"
    np.testing.assert_allclose(shared[1]["loss"], unshared[1]["loss"], rtol=1e-4)


@pytest.fixture(scope="module")
def setup64():
    """The rollout and model in float64 (x64 on while it is built and used only)."""
    with jax.enable_x64(True):
        return _build_setup(jnp.float64)


@pytest.mark.parametrize("mini", [1, 4])
def test_shared_update_equals_unshared_in_float64(setup64, mini):
    """Model, DelTA and loss in float64: the parameters agree to 1e-9 (one update, and a chain
    of four)."""
    with jax.enable_x64(True):
        plans = [_plan("delta", True, mini, 1, share_prompts=s) for s in (True, False)]
        a, b = (_rl_update(setup64, *p) for p in plans)
        assert jax.tree.leaves(a[0].params)[0].dtype == jnp.float64
        assert _max_diff(a[0].params, b[0].params) <= 1e-9
        assert _max_diff(a[0].params, setup64[1]) > 1e-2  # the update moved them


def test_a_group_split_over_rows_is_the_same_update(setup, update):
    """Rows too short for a whole group: a group's responses go into several chunks, each with
    the prompt, and the update is the unshared one's."""
    _, _, rollout = setup
    short = {"tokens_per_row": P + 10 + 2}  # the longest sequence (P + G - 1) and 3 more tokens
    _, plan = _plan("delta", True, share_prompts=True, **short)
    index, _ = plan_rows(plan, np.arange(B), rollout.prompt_lengths, rollout.lengths, 1)
    assert max(_prompt_copies(index).values()) > 1  # some prompt is laid out more than once
    _assert_same(update(True, **short), update(False, **short), atol=1e-5)


def test_the_reference_pass_and_the_entropy_read_the_shared_rows(update):
    """The KL penalty's reference pass and the entropy bonus run on the shared rows too."""
    algo = {"kl_coef": 0.1, "entropy_coef": 0.01}
    shared, unshared = (update(s, "dapo", **algo) for s in (True, False))
    assert shared[2].ref_logprobs is not None
    _assert_same(shared, unshared, atol=1e-5)


def test_shared_rows_sharded_over_8_devices_are_the_single_device_update(setup, update):
    """The trainer's placement: rows sharded over 2 x 4 devices (data x fsdp), parameters and
    optimiser state over fsdp; the update is the unshared one on one device."""
    graphdef, params, rollout = setup
    cfg, plan = _plan("delta", True, share_prompts=True)
    mesh = sh.make_mesh(2, 4, 1, devices=jax.devices()[:8])
    state, _ = init_sharded_state(jax.tree.map(jnp.copy, params), SGD, mesh)
    updater = Updater(graphdef, SGD, plan, mesh, seed=cfg.run.seed, placed_like=state)
    batch, _ = updater.prepare(rollout, 1, state.params)
    assert batch.tokens.shape[2] % 8 == 0 and len(batch.tokens.sharding.device_set) == 8
    state, metrics = updater.update(state, batch)
    single_state, single_metrics, _ = update(False)[:3]
    assert _max_diff(jax.device_get(state.params), single_state.params) <= 1e-5
    np.testing.assert_allclose(metrics["loss"], single_metrics["loss"], rtol=1e-5, atol=1e-6)


def test_lora_adapters_get_the_unshared_update():
    """LoRA (only the adapters differentiated and updated): the same adapters either way."""
    setup = _build_setup(lora_rank=4)
    shared, unshared = (
        _rl_update(setup, *_plan("delta", True, share_prompts=s)) for s in (True, False)
    )
    moved = _max_diff(shared[0].params, setup[1])
    assert moved > 1e-3  # the adapters moved
    assert _max_diff(shared[0].params, unshared[0].params) <= 1e-5


def test_shared_prompts_need_packed_rows():
    with pytest.raises(ConfigError, match=r"^algo.share_prompts=true needs algo.packing=true"):
        load_config(None, ["algo.share_prompts=true", "algo.packing=false"])


def test_a_group_whose_prompts_differ_in_length_is_refused(setup):
    _, _, rollout = setup
    _, plan = _plan("delta", True, share_prompts=True)
    plens = rollout.prompt_lengths.copy()
    plens[1] += 1
    with pytest.raises(ValueError, match=r"share a prompt but not its length"):
        plan_rows(plan, np.arange(B), plens, rollout.lengths, 1)


def test_auto_may_share_unless_splash_would_run_twice_for_rows_that_save_no_prompt():
    """``auto`` is decided once per plan: packed rows, and on TPU (splash, which runs
    twice for shared rows) only rows that hold a longest prompt and two longest responses."""
    from delta_jax.rl.update_plan import UpdatePlan

    def plan(platform="cpu", *overrides):
        shape = ["data.max_prompt_length=16", "rollout.max_new_tokens=24"]
        return UpdatePlan.from_config(load_config(None, [*shape, *overrides]), platform)

    assert plan().share_prompts and plan().share_if_fewer_rows
    assert not plan("cpu", "algo.packing=false").share_prompts
    assert not plan("tpu").share_prompts  # rows of 39: one longest sequence
    assert not plan("tpu").share_if_fewer_rows  # nor any step: the program has no parent ids
    assert not plan("cpu", "algo.packing=false").share_if_fewer_rows
    assert plan("tpu", "algo.tokens_per_row=62").share_prompts  # 16 + 2 x 23
    assert not plan("tpu", "algo.tokens_per_row=61").share_prompts
    assert plan("tpu", "algo.share_prompts=true").share_prompts  # asked for: always
    forced = plan("cpu", "algo.share_prompts=true")
    assert forced.share_prompts and not forced.share_if_fewer_rows
    assert not plan("cpu", "algo.share_prompts=false").share_prompts


@pytest.mark.parametrize(
    ("response", "shared", "rows"),
    [(3, True, 4), (20, False, 16)],  # short: groups share 4 rows; long: one sequence per row
)
def test_auto_shares_a_step_only_where_it_takes_fewer_rows(response, shared, rows):
    """Per step, ``auto`` lays out the rows both ways and keeps sharing only when it needs fewer
    rows: with one sequence per row either way, the unshared rows (narrower window) stay."""
    from delta_jax.rl.update_plan import UpdatePlan

    shape = ["data.max_prompt_length=16", "rollout.max_new_tokens=24"]
    groups = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4"]
    config = load_config(None, [*shape, *groups, "algo.micro_batch_rows=1"])
    plan = UpdatePlan.from_config(config, "cpu")
    plens, glens = np.full(16, 12), np.full(16, response)
    _, stats = plan_rows(plan, np.arange(16), plens, glens, 1)
    assert stats["batch/shared_prompts"] == shared and stats["batch/packed_rows"] == rows
    assert uniform_rows(plan, 12, response, 1) == stats  # the planner's estimate: the same rows
    unshared = 12 * 16 + (response - 1) * 16
    assert stats["batch/positions"] == (12 * 4 + 2 * 16 if shared else unshared)
