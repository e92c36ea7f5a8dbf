"""Stages 2 and 3 of an RL step: a scored rollout -> the update's rows -> optimiser updates.

:class:`Updater` holds the compiled programs of one :class:`~delta_jax.rl.update_plan.UpdatePlan`
(the row assembly, the old-policy / reference pass, DelTA coefficients from the sampler's hidden
states, the train step) and applies them in the plan's order. The :class:`~delta_jax.rl.Trainer`
runs it after each rollout; tests run it on hand-made rollouts.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax import sharding as sh
from delta_jax.rl.packing import make_assemble, plan_rows, row_buckets
from delta_jax.rl.prepare import make_prepare, make_sampler_coefficients
from delta_jax.rl.rollout import Rollout
from delta_jax.rl.state import TrainState
from delta_jax.rl.train_step import (
    TrainBatch,
    combine_metrics,
    make_train_step,
)
from delta_jax.rl.update_plan import UpdatePlan


class Updater:
    """Prepares a rollout batch and applies the plan's optimiser updates.

    Args:
      graphdef: the policy's static graph (``nnx.split(model, nnx.Param)[0]``).
      optimizer: the optax optimiser of the train state.
      plan: the update plan.
      mesh: the trainer's device mesh.
      seed: the run's seed (the mini-batch order of step ``s`` derives from it).
      placed_like: a train state whose placement the compiled update keeps and whose rows are
        sharded over the mesh (the trainer's); None leaves placement to XLA.
      donate: donate the train state to the update (off where a test reuses its input).
    """

    def __init__(
        self,
        graphdef,
        optimizer,
        plan: UpdatePlan,
        mesh,
        *,
        seed: int = 0,
        placed_like: TrainState | None = None,
        donate: bool = True,
    ):
        self.plan, self.mesh, self.seed = plan, mesh, seed
        sharded = placed_like is not None
        placed = mesh if sharded else None  # the mesh the programs place their outputs on
        jit_kwargs = sh.train_jit_kwargs(placed_like, mesh) if sharded else None
        self.train_step = make_train_step(
            graphdef, optimizer, plan, mesh=placed, donate=donate, jit_kwargs=jit_kwargs
        )
        self._prepare = make_prepare(graphdef, plan, mesh=placed)
        rows = sh.rows_sharding(mesh, row_axis=2) if sharded else None
        self._assemble = make_assemble(plan, rows)
        self._coefficients = make_sampler_coefficients(plan, mesh=placed)

    def compile_ahead(self, state: TrainState, rollout_like, params, ref_params=None, log=None):
        """Compiles every program of the update ahead, at each shape of rows a step can lay
        out (one, or each bucket: :func:`~delta_jax.rl.packing.row_buckets`): the row
        assembly, the plan's passes before the update and the mini-batch slices by running them
        on a stand-in rollout whose long responses fill that many rows; the train step, which
        would change the state, lowered and compiled into JAX's persistent cache (its first
        call with that shape loads it). ``rollout_like(lengths)``: a stand-in :class:`Rollout`
        with those response lengths, placed as the trainer's. Returns the shapes compiled."""
        if not jax.config.jax_enable_compilation_cache:
            raise ValueError("compiling ahead keeps the programs in run.compile_cache: turn it on")
        plan, log = self.plan, log or (lambda message: None)
        per, buckets = plan.rows_per_update, row_buckets(plan, sh.batch_divisor(self.mesh))
        aval = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        avals, done = jax.tree.map(aval, state), set()
        full = self._rows(per)  # every sequence long: the most rows
        for i, rows in enumerate(buckets):
            # ``long`` longest responses fill about ``rows`` rows (a row holds per / full).
            long = min(per, max(1, -(-rows * per // full)))
            lengths = np.where(np.arange(plan.rows) < long, plan.gen_len, 0).astype(np.int32)
            batch, _ = self.prepare(rollout_like(lengths), 0, params, ref_params)
            if batch.tokens.shape[2] in done:
                continue
            done.add(batch.tokens.shape[2])
            log(f"compiling the update {i + 1}/{len(buckets)}: {rows} rows per micro-batch")
            for m in range(plan.mini_batches):
                mini = jax.tree.map(lambda x, m=m: x[m], batch)
            with sh.use_mesh(self.mesh):
                self.train_step.lower(avals, jax.tree.map(aval, mini)).compile()
        return len(done)

    def _rows(self, long: int) -> int:
        """Rows the first mini-batch lays out when its first ``long`` responses are the longest
        (and every prompt too)."""
        plan = self.plan
        lengths = np.where(np.arange(plan.rows) < long, plan.gen_len, 0)
        prompts = np.full(plan.rows, plan.prompt_len)
        shards = sh.batch_divisor(self.mesh)
        layout, _ = plan_rows(plan, np.arange(plan.rows), prompts, lengths, shards)
        return int((layout.segment_ids[0].max(-1) > 0).sum())

    def prepare(
        self, rollout: Rollout, step: int, params, ref_params=None
    ) -> tuple[TrainBatch, dict[str, Any]]:
        """The rollout in the update's rows ``[mini, M, b, ...]``, with the plan's fixed inputs.

        Returns:
          The batch and the rollout's metrics with the layout's and DelTA's added (and, for a
          multi-turn rollout, ``batch/action_fraction``: action tokens / response tokens).
        """
        plan, metrics = self.plan, dict(rollout.stats)
        advantages, lengths = jnp.asarray(rollout.advantages), jnp.asarray(rollout.lengths)
        actions = rollout.action_mask
        if actions is not None:
            metrics["batch/action_fraction"] = _action_fraction(actions, lengths)
        coefficients, diagnostics = None, {}
        if plan.coefficients == "sampler":
            coefficients, diagnostics = self._coefficients(
                rollout.hidden, rollout.rollout_logprobs, advantages, lengths, actions
            )
        order = np.arange(plan.rows)
        if plan.mini_batches > 1:
            order = np.random.default_rng(self.seed * 7919 + step).permutation(plan.rows)
        shards = sh.batch_divisor(self.mesh)
        index, layout_stats = plan_rows(
            plan, order, rollout.prompt_lengths, rollout.lengths, shards
        )
        metrics.update(layout_stats)
        index = sh.replicated_to_global(index, self.mesh, row_axis=2)
        batch = self._assemble(
            rollout.sequences, rollout.rollout_logprobs, advantages, coefficients, actions, index
        )
        if plan.old_pass or plan.reference:
            with sh.use_mesh(self.mesh):
                batch, diagnostics = self._prepare(params, ref_params, batch)
        metrics.update({f"delta/{k}": v for k, v in diagnostics.items()})
        if plan.coefficients in ("sampler", "old_pass"):
            metrics["delta/computed_per_rollout"] = 1.0
        elif plan.coefficients == "in_loss":
            metrics["delta/computed_in_loss"] = 1.0
        return batch, metrics

    def update(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict[str, float]]:
        """The plan's optimiser updates, one per mini-batch; their metrics reduced by meaning."""
        per_update = []
        for m in range(self.plan.mini_batches):
            with sh.use_mesh(self.mesh):
                state, metrics = self.train_step(state, jax.tree.map(lambda x, m=m: x[m], batch))
            per_update.append(metrics)
        per_update = jax.device_get(per_update)  # one transfer, after the last update
        stacked = {k: np.stack([u[k] for u in per_update]) for k in per_update[0]}
        means = ("loss", "pg_loss", "grad_norm", "update_skipped")
        metrics = combine_metrics(stacked, means=means)
        metrics.pop("tokens")
        metrics["updates_skipped_total"] = int(state.skipped)
        return state, {k: float(v) if not isinstance(v, int) else v for k, v in metrics.items()}


@jax.jit
def _action_fraction(action_mask, lengths):
    """Action tokens / response tokens of a rollout (the other response tokens are observations)."""
    response = jnp.arange(action_mask.shape[1]) < lengths[:, None]
    return jnp.sum(action_mask & response) / jnp.maximum(jnp.sum(response), 1)
