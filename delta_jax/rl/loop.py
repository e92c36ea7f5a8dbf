"""The RL outer loop: prompts -> rollouts -> rewards -> DelTA update -> metrics -> checkpoints.

One RL step:

1. take ``prompts_per_step`` prompts from the grain pipeline and sample ``n`` responses each with
   the sampler, reading the trainer's current parameters (no copy);
2. score them (process pool, timeouts), add the overlong penalty, compute group advantages
   (dynamic sampling when configured);
3. when the rollout batch feeds several updates (``algo.mini_batches > 1``): one old-policy pass
   gives the old log-probs and — for DelTA — the hidden states, from which the coefficients are
   computed **once** for the rollout batch and held fixed (DELTA_SPEC §4); when one update uses
   the whole batch, the jitted loss computes them from its own forward pass (no extra pass);
   with gradient accumulation (``algo.micro_batches > 1``) and one update, they come from the
   sampler's hidden states — again no extra model pass;
4. apply the updates, log, evaluate, checkpoint.

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
from delta_jax.losses import delta_coefficients_microbatched, forking_tokens_mask
from delta_jax.rl.metrics_log import MetricsLog
from delta_jax.rl.rollout import Rollout, collect_rollout
from delta_jax.rl.setup import RunParts, build_run_parts
from delta_jax.rl.train_step import TrainBatch, make_optimizer, make_train_step

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


def _micro(x: np.ndarray | jax.Array | None, micro: int):
    """[rows, ...] -> [micro, rows // micro, ...]."""
    if x is None:
        return None
    return jnp.asarray(x).reshape(micro, x.shape[0] // micro, *x.shape[1:])


def _old_policy_stats(parts: RunParts, params, rollout: Rollout, micro_rows: int) -> dict:
    """Old log-probs, entropy and DelTA coefficients of a rollout batch, one forward per chunk."""
    logps, entropies, hiddens = [], [], []
    for start in range(0, rollout.input_ids.shape[0], micro_rows):
        sl = slice(start, start + micro_rows)
        logp, entropy, hidden = parts.old_pass(
            params, jnp.asarray(rollout.input_ids[sl]), jnp.asarray(rollout.attention_mask[sl])
        )
        logps.append(logp)
        entropies.append(entropy)
        hiddens.append(hidden)
    out: dict[str, Any] = {"old_logprobs": jnp.concatenate(logps)}
    mask = jnp.asarray(rollout.response_mask)
    if parts.objective.uses_forking_mask:
        out["token_mask"] = forking_tokens_mask(
            jnp.concatenate(entropies), mask, top_q=parts.objective.forking_top_q
        )
    if parts.objective.uses_delta:
        adv = jnp.asarray(rollout.advantages)
        chunks = lambda x: [x[s : s + micro_rows] for s in range(0, x.shape[0], micro_rows)]
        coefs, diag = delta_coefficients_microbatched(
            hiddens,
            logps,
            chunks(adv),
            chunks(mask),
            return_diagnostics=True,
            **parts.objective.delta_kwargs,
        )
        out["coefficients"] = jnp.concatenate(coefs)
        out["delta_diagnostics"] = diag
    return out


def train(config: Config) -> TrainResult:
    """Run (or resume) the RL job described by ``config``; returns where its outputs are."""
    mesh = sh.mesh_from_config(config.run.mesh)
    parts = build_run_parts(config, mesh=mesh)
    run_dir, cfg = parts.run_dir, config
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    mini, micro = cfg.algo.mini_batches, cfg.algo.micro_batches
    gen_len = cfg.rollout.max_new_tokens

    optimizer = make_optimizer(cfg.optim, total_updates=cfg.run.steps * mini)
    graphdef, params = nnx.split(parts.model, nnx.Param)
    state, _ = sh.init_sharded_state(params, optimizer, mesh)
    ref_params = jax.tree.map(jnp.copy, params) if cfg.algo.kl_coef > 0 else None
    train_step = make_train_step(
        graphdef,
        optimizer,
        parts.objective,
        temperature=cfg.rollout.temperature or 1.0,
        gen_len=gen_len,
        jit_kwargs=sh.train_jit_kwargs(state, mesh),
    )

    ckpt = Checkpointer(
        run_dir / "checkpoints", keep_last=cfg.run.keep_last, best_metric=cfg.run.best_metric
    )
    start = 0
    latest = ckpt.latest_step()
    if latest is not None:
        state, host = ckpt.restore(latest, state)
        parts.pipeline.set_state(host["data"])
        start = latest
        log.info("resumed from %s at step %d", ckpt.directory, start)
    writer = jax.process_index() == 0
    metrics_log = MetricsLog(
        run_dir,
        enabled=writer,
        tensorboard=cfg.run.tensorboard,
        wandb=cfg.run.wandb,
        resume_step=start,
        config=cfg.to_dict(),
    )
    if writer:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    inline_delta = parts.objective.uses_delta and mini == 1 and micro == 1
    use_sampler_hidden = parts.objective.uses_delta and mini == 1 and micro > 1
    need_old_pass = mini > 1
    sampling = dict(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        stop_token_ids=parts.stop_token_ids,
    )
    progress = None
    if writer and cfg.run.progress:
        from tqdm import tqdm

        progress = tqdm(total=cfg.run.steps, initial=start, desc="rl", dynamic_ncols=True)

    _CompileCounter.install()
    if cfg.run.eval_every and start == 0:
        # The starting point of the learning curve: the policy before any RL update.
        metrics_log.log(0, parts.evaluate(sh.reshard_for_sampling(state.params, mesh), 0))
    step = start
    stopped = False
    with _StopFlag() as stop:
        for step in range(start + 1, cfg.run.steps + 1):
            t_step = time.perf_counter()
            compiles_before = _CompileCounter.count
            rollout = collect_rollout(
                sampler=parts.sampler,
                params=sh.reshard_for_sampling(state.params, mesh),
                scorer=parts.scorer,
                tokenizer=parts.tokenizer,
                prompt_batches=parts.prompt_batches(),
                n=cfg.rollout.samples_per_prompt,
                prompt_len=parts.prompt_len,
                gen_len=gen_len,
                sampling=sampling,
                seed=cfg.run.seed * 1_000_003 + step,
                advantage=cfg.algo.advantage,
                overlong=(cfg.reward.overlong_buffer, cfg.reward.overlong_factor),
                dynamic_rounds=cfg.rollout.dynamic_sampling_rounds,
                return_hidden=use_sampler_hidden,
            )
            t_update = time.perf_counter()
            fixed: dict[str, Any] = {}
            metrics: dict[str, Any] = dict(rollout.stats)
            if need_old_pass:
                fixed = _old_policy_stats(parts, state.params, rollout, rows // mini // micro)
                metrics["delta/computed_per_rollout"] = float(parts.objective.uses_delta)
            elif use_sampler_hidden:
                coefs, diag = parts.delta_from_hidden(
                    rollout.hidden,
                    jnp.asarray(rollout.rollout_logprobs),
                    jnp.asarray(rollout.advantages),
                    jnp.asarray(rollout.response_mask),
                )
                fixed = {"coefficients": coefs, "delta_diagnostics": diag}
            if "delta_diagnostics" in fixed:
                metrics.update(
                    {f"delta/{k}": float(v) for k, v in fixed.pop("delta_diagnostics").items()}
                )
            ref_logprobs = None
            if ref_params is not None:
                ref_logprobs = parts.ref_logprobs(ref_params, rollout, rows // mini // micro)
            order = np.random.default_rng(cfg.run.seed * 7919 + step).permutation(rows)
            if mini == 1:
                order = np.arange(rows)
            update_metrics = []
            for m in range(mini):
                idx = order[m * (rows // mini) : (m + 1) * (rows // mini)]

                def take(x, idx=idx):
                    return None if x is None else x[idx]

                batch = TrainBatch(
                    input_ids=_micro(rollout.input_ids[idx], micro),
                    attention_mask=_micro(rollout.attention_mask[idx], micro),
                    response_mask=_micro(rollout.response_mask[idx], micro),
                    advantages=_micro(rollout.advantages[idx], micro),
                    old_logprobs=_micro(take(fixed.get("old_logprobs")), micro),
                    coefficients=_micro(take(fixed.get("coefficients")), micro),
                    token_mask=_micro(take(fixed.get("token_mask")), micro),
                    rollout_logprobs=_micro(rollout.rollout_logprobs[idx], micro),
                    ref_logprobs=_micro(take(ref_logprobs), micro),
                )
                with sh.use_mesh(mesh):
                    state, step_metrics = train_step(state, sh.replicated_to_global(batch, mesh))
                update_metrics.append(step_metrics)
            update_metrics = jax.device_get(update_metrics)
            for key in update_metrics[0]:
                metrics[key] = float(np.mean([m[key] for m in update_metrics]))
            metrics["updates_skipped_total"] = int(state.skipped)
            metrics["time/update"] = time.perf_counter() - t_update
            if inline_delta:
                metrics["delta/computed_in_loss"] = 1.0
            if cfg.run.eval_every and step % cfg.run.eval_every == 0:
                t_eval = time.perf_counter()
                metrics.update(parts.evaluate(sh.reshard_for_sampling(state.params, mesh), step))
                metrics["time/eval"] = time.perf_counter() - t_eval
            metrics["time/step"] = time.perf_counter() - t_step
            metrics["compiles"] = _CompileCounter.count - compiles_before
            row = metrics_log.log(step, metrics)
            if progress is not None:
                progress.set_postfix(
                    reward=f"{row['reward_mean']:.3f}", loss=f"{row.get('loss') or 0:.4f}"
                )
                progress.update(1)
            if step % cfg.run.save_every == 0 or step == cfg.run.steps or stop.requested:
                ckpt.save(
                    step,
                    state,
                    host={"data": parts.pipeline.get_state(), "step": step, "seed": cfg.run.seed},
                    metrics={k: v for k, v in row.items() if isinstance(v, int | float)},
                )
            if stop.requested:
                stopped = True
                break
    ckpt.close()
    parts.close()
    metrics_log.close()
    if progress is not None:
        progress.close()
    plot_path = None
    if writer:
        from delta_jax.diagnostics.plots import plot_runs

        plot_path = plot_runs([run_dir], run_dir / "learning_curve.png")
    return TrainResult(
        run_dir=run_dir,
        last_step=step,
        metrics_path=metrics_log.path,
        checkpoint_dir=ckpt.directory,
        plot_path=plot_path,
        stopped_early=stopped,
    )
