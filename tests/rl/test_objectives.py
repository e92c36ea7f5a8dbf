"""rl/objectives: each ``algo.loss`` preset is the documented policy_loss, bit for bit.

The presets are written out here as policy_loss options (the table of ``losses.PRESETS``); the
objective built from the config must give the same loss, metrics and gradient exactly (both
are the same jax.numpy operations), and its options must be the loss library's preset."""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delta_jax import losses
from delta_jax.config import ConfigError, LossName, load_config
from delta_jax.losses import DeltaOptions, PolicyLossOptions, TermInputs, policy_loss
from delta_jax.rl.objectives import resolve_objective

G = 7  # rollout.max_new_tokens: Dr.GRPO's constant
PRESETS = {
    "delta": dict(loss_type="ppo", clip_eps_low=0.2, clip_eps_high=0.28),
    "dapo": dict(loss_type="ppo", clip_eps_low=0.2, clip_eps_high=0.28),
    "dapo_forking_tokens": dict(loss_type="ppo", clip_eps_low=0.2, clip_eps_high=0.28),
    "grpo": dict(
        loss_type="ppo", clip_eps_low=0.2, clip_eps_high=0.2, aggregation="seq-mean-token-mean"
    ),
    "dr_grpo": dict(
        loss_type="ppo",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        aggregation="seq-mean-token-sum-norm",
        max_response_length=G,
    ),
    "gspo": dict(
        loss_type="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="seq-mean-token-mean"
    ),
    "sapo": dict(loss_type="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05),
}
# config overrides -> the policy_loss arguments they add (None: the preset decides)
OVERRIDES = {
    "plain": ((), {}),
    "kl_entropy_tis": (
        ("algo.kl_coef=0.1", "algo.kl_estimator=k2", "algo.entropy_coef=0.01", "algo.tis_cap=2"),
        dict(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01, tis_cap=2.0),
    ),
    "clip_and_aggregation": (
        (
            "algo.clip_eps_low=0.1",
            "algo.clip_eps_high=0.3",
            "algo.dual_clip_c=null",
            "algo.aggregation=seq-mean-token-sum",
        ),
        dict(
            clip_eps_low=0.1, clip_eps_high=0.3, dual_clip_c=None, aggregation="seq-mean-token-sum"
        ),
    ),
}


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    B, T = 6, G
    mask = np.arange(T)[None] < np.array([7, 4, 1, 0, 6, 3])[:, None]
    old = -rng.uniform(0.1, 2.0, (B, T)).astype(np.float32)
    lp = (old + rng.uniform(-0.4, 0.4, (B, T))).astype(np.float32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return dict(
        logprobs=f32(lp),
        old_logprobs=f32(old),
        advantages=f32(np.repeat(rng.normal(size=(B, 1)), T, 1)),
        mask=jnp.asarray(mask),
        coefficients=f32(rng.uniform(0.8, 1.2, (B, T))),
        token_mask=jnp.asarray(rng.uniform(size=(B, T)) < 0.7),
        rollout_logprobs=f32(old + rng.uniform(-0.3, 0.3, (B, T))),
        ref_logprobs=f32(lp + rng.uniform(-0.3, 0.3, (B, T))),
        entropy=f32(rng.uniform(0.0, 2.0, (B, T))),
    )


@pytest.mark.parametrize("override", list(OVERRIDES))
@pytest.mark.parametrize("loss", list(PRESETS))
def test_objective_is_its_documented_policy_loss(loss, override):
    overrides, extra = OVERRIDES[override]
    if loss == "sapo" and override == "clip_and_aggregation":
        pytest.skip("refused at load: test_sapo_refuses_clip_settings")
    config = load_config(None, [f"algo.loss={loss}", f"rollout.max_new_tokens={G}", *overrides])
    objective = resolve_objective(config.algo, max_response_length=G)
    kwargs = {**PRESETS[loss], **extra}
    if kwargs.get("aggregation") != "seq-mean-token-sum-norm":
        kwargs.pop("max_response_length", None)
    b = _batch()
    mask, normalizer = b["mask"], objective.count(b["mask"], None)
    data = dict(coefficients=b["coefficients"], token_mask=b["token_mask"])
    if "tis_cap" in kwargs:
        data["rollout_logprobs"] = b["rollout_logprobs"]
    if "kl_coef" in kwargs:
        data["ref_logprobs"] = b["ref_logprobs"]

    options = PolicyLossOptions(**kwargs)

    def want(lp, ent):
        terms = TermInputs(
            rollout_logprobs=data.get("rollout_logprobs"),
            ref_logprobs=data.get("ref_logprobs"),
            entropy=ent if "entropy_coef" in kwargs else None,
        )
        return policy_loss(
            lp,
            b["old_logprobs"],
            b["advantages"],
            mask,
            options,
            normalizer=normalizer,
            coefficients=data["coefficients"],
            token_mask=data["token_mask"],
            terms=terms,
        )

    def got(lp, ent):
        return objective(
            lp,
            b["old_logprobs"],
            b["advantages"],
            mask,
            normalizer=normalizer,
            coefficients=b["coefficients"],
            token_mask=b["token_mask"],
            terms=TermInputs(b["rollout_logprobs"], data.get("ref_logprobs"), ent),
        )

    assert objective.needs_entropy == ("entropy_coef" in kwargs or loss.endswith("tokens"))
    grad = lambda f: jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))
    expected = grad(want)(b["logprobs"], b["entropy"])
    actual = grad(got)(b["logprobs"], b["entropy"])
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_objective_flags():
    algo = lambda *o: resolve_objective(load_config(None, list(o)).algo, max_response_length=G)
    assert algo("algo.loss=delta").uses_delta and not algo("algo.loss=dapo").uses_delta
    forking = algo("algo.loss=dapo_forking_tokens", "algo.forking_top_q=0.3")
    assert forking.uses_forking_mask and forking.forking_top_q == 0.3 and forking.needs_entropy
    assert not algo("algo.loss=dapo").needs_entropy
    assert algo("algo.loss=delta", "algo.refine_steps=2").delta.refine_steps == 2


@pytest.mark.parametrize("loss", typing.get_args(LossName))
def test_trainer_resolves_the_loss_librarys_presets(loss):
    """The default config of each algo.loss resolves to losses.PRESETS[loss] (Dr.GRPO's
    constant bound in) and, for delta, DeltaOptions() with the spec's defaults; the preset
    holds the values written out in PRESETS here."""
    config = load_config(None, [f"algo.loss={loss}", f"rollout.max_new_tokens={G}"])
    objective = resolve_objective(config.algo, max_response_length=G)
    preset = losses.PRESETS[loss]
    if preset.aggregation == "seq-mean-token-sum-norm":
        preset = dataclasses.replace(preset, max_response_length=G)
    assert objective.options == preset
    assert objective.delta == (DeltaOptions() if loss == "delta" else None)
    written = PolicyLossOptions(**PRESETS[loss])
    assert preset.clip_range() == written.clip_range()
    assert dataclasses.replace(preset, clip_eps_low=None, clip_eps_high=None) == (
        dataclasses.replace(written, clip_eps_low=None, clip_eps_high=None)
    )
    assert set(losses.PRESETS) == set(typing.get_args(LossName))


@pytest.mark.parametrize(
    "override", ["algo.clip_eps_low=0.1", "algo.clip_eps_high=0.3", "algo.dual_clip_c=null"]
)
def test_sapo_refuses_clip_settings(override):
    with pytest.raises(ConfigError, match=r"does not apply to algo.loss=sapo"):
        load_config(None, ["algo.loss=sapo", override])
