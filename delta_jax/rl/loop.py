"""The RL outer loop: rollout -> score -> prepare -> update(s) -> log/save.

One RL step (:func:`train`), each stage a function below, in this order:

1. **rollout + score** (:func:`delta_jax.rl.rollout.collect_rollout`): ``prompts_per_step``
   prompts from the grain pipeline, ``n`` responses each from the sampler (reading the trainer's
   current parameters, no copy), rewards (process pool, timeouts) plus the overlong penalty, group
   advantages, dynamic sampling when configured. Sequences, log-probs and hidden states stay on
   device; the host reads the token ids only to decode the text the rewards need;
2. **prepare** (:func:`_prepare`): the sequences go into the update's rows — packed
   first-fit-decreasing into ``algo.tokens_per_row`` (``algo.packing``), or one padded per row —
   by one on-device gather (:mod:`delta_jax.rl.packing`); then, as the
   :class:`~delta_jax.rl.update_plan.UpdatePlan` says, DelTA coefficients from the sampler's
   hidden states, or the old-policy pass (old log-probs, coefficients once per rollout batch),
   and the reference pass (:mod:`delta_jax.rl.prepare`);
3. **update(s)** (:func:`_update`): ``algo.mini_batches`` optimiser updates, each accumulating
   ``algo.micro_batches`` micro-batches; metrics reduced by meaning;
4. **log / evaluate / save** (:func:`_finish_step`).

Resume is exact: sampling seeds derive from (seed, step), the data iterator state is saved with
the parameters and optimiser state, and metrics lines after the restored step are dropped.
SIGTERM finishes the current step, saves and exits cleanly.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from delta_jax import sharding as sh
from delta_jax.checkpoint import Checkpointer
from delta_jax.config import Config
from delta_jax.rl.metrics_log import MetricsLog
from delta_jax.rl.packing import make_assemble, plan_rows
from delta_jax.rl.prepare import make_prepare, make_sampler_coefficients
from delta_jax.rl.rollout import Rollout, collect_rollout
from delta_jax.rl.setup import RunParts, build_run_parts
from delta_jax.rl.state import TrainState, init_sharded_state, make_optimizer
from delta_jax.rl.train_step import TrainBatch, combine_metrics, make_train_step
from delta_jax.rl.update_plan import UpdatePlan

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    last_step: int
    metrics_path: Path
    checkpoint_dir: Path
    plot_path: Path | None
    stopped_early: bool


class _CompileCounter:
    """Counts XLA backend compilations (jitted programs and eager ops) in this process.

    Logged per step as ``compiles``: after the first step of a run it should stay 0 — the update,
    old-log-prob pass and sampler each compile once per shape bucket.
    """

    count = 0
    _registered = False

    @classmethod
    def install(cls) -> None:
        if not cls._registered:
            jax.monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._registered = True

    @classmethod
    def _on_event(cls, name: str, duration: float, **kwargs) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            cls.count += 1


class _StopFlag:
    """Set by SIGTERM: the loop finishes its step, saves and returns."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no signal handling
            self._previous = None
        return self

    def _handle(self, signum, frame):
        log.warning("SIGTERM received: finishing the current step, saving, then exiting")
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


@dataclasses.dataclass
class _Run:
    """A run's fixed parts and its evolving train state."""

    config: Config
    mesh: Any
    parts: RunParts
    plan: UpdatePlan
    state: TrainState
    ref_params: Any  # the frozen reference policy (plan.reference), else None
    train_step: Any
    prepare: Any
    assemble: Any
    sampler_coefficients: Any
    checkpointer: Checkpointer
    metrics_log: MetricsLog
    start: int


def train(config: Config) -> TrainResult:
    """Run (or resume) the RL job described by ``config``; returns where its outputs are."""
    run = _start(config)
    cfg, writer = config, jax.process_index() == 0
    progress = None
    if writer and cfg.run.progress:
        from tqdm import tqdm

        progress = tqdm(total=cfg.run.steps, initial=run.start, desc="rl", dynamic_ncols=True)
    _CompileCounter.install()
    if cfg.run.eval_every and run.start == 0:
        # The starting point of the learning curve: the policy before any RL update.
        run.metrics_log.log(0, _evaluate(run, 0))
    step, stopped = run.start, False
    with _StopFlag() as stop:
        for step in range(run.start + 1, cfg.run.steps + 1):
            t_step, compiles = time.perf_counter(), _CompileCounter.count
            rollout = _rollout(run, step)
            t_update = time.perf_counter()
            batch, metrics = _prepare(run, rollout, step)
            metrics.update(_update(run, batch))
            metrics["time/update"] = time.perf_counter() - t_update
            # Read the flag once: the step that saves is the step that stops (a SIGTERM
            # arriving after this line is served at the end of the next step).
            stopped = stop.requested
            row = _finish_step(run, step, metrics, t_step, compiles, stopped)
            if progress is not None:
                loss = row.get("loss") or 0
                progress.set_postfix(reward=f"{row['reward_mean']:.3f}", loss=f"{loss:.4f}")
                progress.update(1)
            if stopped:
                break
    run.checkpointer.close()
    run.parts.close()
    run.metrics_log.close()
    if progress is not None:
        progress.close()
    plot_path = None
    if writer:
        from delta_jax.diagnostics.plots import plot_runs

        plot_path = plot_runs([run.parts.run_dir], run.parts.run_dir / "learning_curve.png")
    return TrainResult(
        run_dir=run.parts.run_dir,
        last_step=step,
        metrics_path=run.metrics_log.path,
        checkpoint_dir=run.checkpointer.directory,
        plot_path=plot_path,
        stopped_early=stopped,
    )


def _start(cfg: Config) -> _Run:
    """Mesh, run parts, update plan, compiled programs, train state (restored when resuming)."""
    mesh = sh.mesh_from_config(cfg.run.mesh)
    parts = build_run_parts(cfg, mesh=mesh)
    plan = UpdatePlan.from_config(cfg)
    optimizer = make_optimizer(cfg.optim, total_updates=cfg.run.steps * plan.mini_batches)
    graphdef, params = nnx.split(parts.model, nnx.Param)
    state, _ = init_sharded_state(params, optimizer, mesh)
    ckpt = Checkpointer(
        parts.run_dir / "checkpoints", keep_last=cfg.run.keep_last, best_metric=cfg.run.best_metric
    )
    # The reference is the initial policy, also when resuming.
    ref_params = jax.tree.map(jnp.copy, state.params) if plan.reference else None
    start, state, host = ckpt.restore_latest(state)
    if start:
        parts.pipeline.set_state(host["data"])
        log.info("resumed from %s at step %d", ckpt.directory, start)
    writer = jax.process_index() == 0
    metrics_log = MetricsLog(
        parts.run_dir,
        enabled=writer,
        tensorboard=cfg.run.tensorboard,
        wandb=cfg.run.wandb,
        resume_step=start,
        config=cfg.to_dict(),
    )
    if writer:
        (parts.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return _Run(
        config=cfg,
        mesh=mesh,
        parts=parts,
        plan=plan,
        state=state,
        ref_params=ref_params,
        train_step=make_train_step(
            graphdef, optimizer, plan, mesh=mesh, jit_kwargs=sh.train_jit_kwargs(state, mesh)
        ),
        prepare=make_prepare(graphdef, plan, mesh=mesh),
        assemble=make_assemble(plan, sh.rows_sharding(mesh, row_axis=2)),
        sampler_coefficients=make_sampler_coefficients(plan, mesh=mesh),
        checkpointer=ckpt,
        metrics_log=metrics_log,
        start=start,
    )


def _rollout(run: _Run, step: int) -> Rollout:
    """Sample and score one rollout batch with the current parameters."""
    cfg, parts = run.config, run.parts
    rollout = collect_rollout(
        sampler=parts.sampler,
        params=_sampling_params(run),
        scorer=parts.scorer,
        tokenizer=parts.tokenizer,
        prompt_batches=parts.prompt_batches(),
        n=cfg.rollout.samples_per_prompt,
        prompt_len=parts.prompt_len,
        gen_len=cfg.rollout.max_new_tokens,
        sampling=dict(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            stop_token_ids=parts.stop_token_ids,
        ),
        seed=cfg.run.seed * 1_000_003 + step,
        advantage=cfg.algo.advantage,
        overlong=(cfg.reward.overlong_buffer, cfg.reward.overlong_factor),
        dynamic_rounds=cfg.rollout.dynamic_sampling_rounds,
        return_hidden=run.plan.coefficients == "sampler",
    )
    # Back from the sampler's mesh to the trainer's rows (a no-op when the layouts agree).
    moved = sh.replicated_to_global(
        (rollout.sequences, rollout.rollout_logprobs, rollout.hidden), run.mesh, row_axis=0
    )
    return dataclasses.replace(
        rollout, sequences=moved[0], rollout_logprobs=moved[1], hidden=moved[2]
    )


def _sampling_params(run: _Run):
    """The trainer's parameters in the sampler's layout: its mesh, the compute dtype."""
    sampler = run.parts.sampler
    return sh.reshard_for_sampling(
        run.state.params, run.mesh, sample_mesh=sampler.mesh, dtype=run.config.model.dtype
    )


def _prepare(run: _Run, rollout: Rollout, step: int) -> tuple[TrainBatch, dict[str, Any]]:
    """The rollout in the update's rows ``[mini, M, b, ...]``, with the plan's fixed inputs."""
    plan, metrics = run.plan, dict(rollout.stats)
    advantages = jnp.asarray(rollout.advantages)
    coefficients, diagnostics = None, {}
    if plan.coefficients == "sampler":
        coefficients, diagnostics = run.sampler_coefficients(
            rollout.hidden, rollout.rollout_logprobs, advantages, jnp.asarray(rollout.lengths)
        )
    order = np.arange(plan.rows)
    if plan.mini_batches > 1:
        order = np.random.default_rng(run.config.run.seed * 7919 + step).permutation(plan.rows)
    shards = sh.batch_divisor(run.mesh)
    index, layout_stats = plan_rows(plan, order, rollout.prompt_lengths, rollout.lengths, shards)
    metrics.update(layout_stats)
    index = sh.replicated_to_global(index, run.mesh, row_axis=2)
    batch = run.assemble(
        rollout.sequences, rollout.rollout_logprobs, advantages, coefficients, index
    )
    if plan.old_pass or plan.reference:
        with sh.use_mesh(run.mesh):
            batch, diagnostics = run.prepare(run.state.params, run.ref_params, batch)
    metrics.update({f"delta/{k}": v for k, v in diagnostics.items()})
    if plan.coefficients in ("sampler", "old_pass"):
        metrics["delta/computed_per_rollout"] = 1.0
    elif plan.coefficients == "in_loss":
        metrics["delta/computed_in_loss"] = 1.0
    return batch, metrics


def _update(run: _Run, batch: TrainBatch) -> dict[str, float]:
    """The plan's optimiser updates, one per mini-batch; their metrics reduced by meaning."""
    per_update = []
    for m in range(run.plan.mini_batches):
        with sh.use_mesh(run.mesh):
            run.state, metrics = run.train_step(run.state, jax.tree.map(lambda x, m=m: x[m], batch))
        per_update.append(metrics)
    per_update = jax.device_get(per_update)  # one transfer, after the last update
    stacked = {k: np.stack([u[k] for u in per_update]) for k in per_update[0]}
    means = ("loss", "pg_loss", "grad_norm", "update_skipped")
    metrics = combine_metrics(stacked, means=means)
    metrics.pop("tokens")
    metrics["updates_skipped_total"] = int(run.state.skipped)
    return {k: float(v) if not isinstance(v, int) else v for k, v in metrics.items()}


def _evaluate(run: _Run, step: int) -> dict[str, float]:
    return run.parts.evaluate(_sampling_params(run), step)


def _finish_step(run: _Run, step, metrics, t_step, compiles, stopping) -> dict[str, Any]:
    """Evaluate when due, log the step's metrics, save when due; returns the logged row."""
    cfg = run.config
    if cfg.run.eval_every and step % cfg.run.eval_every == 0:
        t_eval = time.perf_counter()
        metrics.update(_evaluate(run, step))
        metrics["time/eval"] = time.perf_counter() - t_eval
    metrics["time/step"] = time.perf_counter() - t_step
    metrics["compiles"] = _CompileCounter.count - compiles
    row = run.metrics_log.log(step, metrics)
    if cfg.run.save_due(step, stopping):
        run.checkpointer.save(
            step,
            run.state,
            host={"data": run.parts.pipeline.get_state(), "step": step, "seed": cfg.run.seed},
            metrics={k: v for k, v in row.items() if isinstance(v, int | float)},
        )
    return row
