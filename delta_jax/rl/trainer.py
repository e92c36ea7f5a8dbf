"""The trainer: the library's front door, one RL step at a time.

One RL step (:meth:`Trainer.step`), each stage a function below, in this order:

1. **rollout + score** (:func:`delta_jax.rl.rollout.collect_rollout`): ``prompts_per_step``
   prompts from the checkpointable prompt source, ``n`` responses each from the sampler (reading
   the trainer's current parameters, no copy) — multi-turn episodes when an environment is set
   (:mod:`delta_jax.envs.episodes`: tool calls run on the host while the engine decodes),
   rewards (worker pools, timeouts) plus the overlong
   penalty, group advantages, dynamic sampling when configured. Sequences, log-probs and hidden
   states stay on device; the host reads the token ids only to decode the text the rewards need.
   Partial rollouts (``rollout.over_provision``) carry unfinished groups between steps;
   asynchronous rollouts (``rollout.async_devices``) sample each step's batch on their own
   devices beside the previous step's update (:mod:`delta_jax.rl.pipeline`);
2. **prepare** (:meth:`~delta_jax.rl.update.Updater.prepare`): the sequences go into the
   update's rows — packed first-fit-decreasing into ``algo.tokens_per_row`` (``algo.packing``),
   or one padded per row — by one on-device gather (:mod:`delta_jax.rl.packing`); then, as the
   :class:`~delta_jax.rl.update_plan.UpdatePlan` says, DelTA coefficients from the sampler's
   hidden states, or the old-policy pass (old log-probs, coefficients once per rollout batch),
   and the reference pass (:mod:`delta_jax.rl.prepare`);
3. **update(s)** (:meth:`~delta_jax.rl.update.Updater.update`): ``algo.mini_batches``
   optimiser updates, each accumulating its micro-batches (of ``algo.micro_batch_rows`` packed
   rows, as many as the rows need: one program whatever the lengths); metrics reduced by
   meaning;
4. **log / evaluate / save** (:meth:`Trainer._finish`).

Resume is exact: sampling seeds derive from (seed, step), the prompt source's state is saved
with the parameters and optimiser state, and metrics lines after the restored step are dropped.
In :meth:`Trainer.train`, SIGTERM finishes the current step, saves and returns.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx
from tqdm import tqdm

from delta_jax import distributed, extras
from delta_jax import sharding as sh
from delta_jax.checkpoint import Checkpointer
from delta_jax.config import Config, ConfigError, build_config, load_config
from delta_jax.diagnostics.metrics_log import MetricsLog
from delta_jax.diagnostics.plots import plot_runs
from delta_jax.rl.compilation import CompileCounter, use_persistent_cache, warm_up_rollout
from delta_jax.rl.host_state import pack, unpack
from delta_jax.rl.partial import Clock
from delta_jax.rl.pipeline import RolloutsAhead, partial_buffer, split_meshes
from delta_jax.rl.rollout import (
    DEVICE_FIELDS,
    Rollout,
    RolloutSpec,
    collect_rollout,
    rollout_from_host,
    rollout_to_host,
)
from delta_jax.rl.setup import RunParts, build_run_parts
from delta_jax.rl.state import init_sharded_state, make_optimizer
from delta_jax.rl.update import Updater
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


def as_config(config: Config | str | Path | Mapping[str, Any] | None) -> Config:
    """A :class:`Config` from itself, a YAML path, or overrides of the built-in defaults.

    Overrides are ``{"section.key": value}`` or nested ``{"section": {"key": value}}``.
    """
    if config is None or isinstance(config, Config):
        return config or load_config(None)
    if isinstance(config, str | Path):
        return load_config(config)
    if isinstance(config, Mapping):
        flat = []
        for key, value in config.items():
            # {"data": {...}} is a section; {"data.gym_options": {...}} a key whose value is one.
            section = isinstance(value, Mapping) and "." not in str(key)
            items = value.items() if section else [(None, value)]
            for sub, v in items:
                dotted = key if sub is None else f"{key}.{sub}"
                flat.append((dotted, v))
        values: dict[str, dict[str, Any]] = {}
        for dotted, v in flat:
            if not isinstance(dotted, str) or dotted.count(".") != 1:
                raise ConfigError(f"config key {dotted!r} must be section.key (e.g. algo.loss)")
            section, key = dotted.split(".")
            values.setdefault(section, {})[key] = v
        return build_config(values)
    raise ConfigError(
        f"config must be a Config, a YAML path or a dict of section.key overrides, "
        f"got {type(config).__name__}"
    )


def require_extras(cfg: Config) -> None:
    """What the run needs beyond the package's dependencies, checked before anything loads
    (reasoning-gym sources and rewards are checked with the config itself).

    Raises:
      extras.MissingExtra: one line naming the install that adds the missing extra.
    """
    distributed.check_tpu_runtime()
    if cfg.run.wandb and not extras.installed("wandb"):
        raise extras.MissingExtra(extras.missing("wandb", "run.wandb=true"))


class Trainer:
    """An RL run of a policy on prompts with verifiable rewards (DelTA by default).

    Args:
      config: a :class:`~delta_jax.config.Config`, a YAML path, or a dict of ``section.key``
        overrides of the built-in defaults (the CPU demo).
      model: a :class:`~delta_jax.models.Transformer` (e.g. from
        :func:`~delta_jax.models.from_pretrained`, LoRA applied or not), instead of
        ``model.path``; used as it is (``model.lora_rank > 0`` adds adapters if it has none).
      tokenizer: any Hugging Face tokenizer (added tokens included), instead of the one in
        ``model.path``.
      train_dataset: a ``datasets.Dataset``, a ``datasets.IterableDataset``, a list of dicts
        or a reasoning-gym data set (``reasoning_gym.create_dataset(...)``), instead of
        ``data.source``; read with ``data.adapter`` and ``data.template`` as a file
        would be (:mod:`delta_jax.data.objects` says what a resume promises for each).
      eval_dataset: the held-out prompts, likewise, instead of ``data.eval_source``.
      reward_fns: reward functions instead of ``reward.kind``: kinds (``"math"``, ``"code"``,
        ``"format"``, ``"reasoning_gym"``), ``"module:function"`` paths, or callables
        ``fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]``
        (``columns``: the rows' other fields as lists; ``None``: does not apply, reward 0).
      reward_weights: one weight per reward function (default 1 each); the reward is the sum.
      environment: multi-turn episodes instead of ``rollout.environment``: an
        :class:`~delta_jax.envs.Environment` (copied for each episode) or a callable returning
        a fresh one. Its ``reset(row)`` gives the first user turn, its ``step(turn)`` answers
        each model turn (a tool's output) until the episode is done or ``rollout.max_turns``;
        observations are context (no loss); the reward functions score the whole episode's
        text, plus the environment's own reward when it gives one.

    Example::

      def exact(prompts, completions, answer, **columns):
          return [float(a in c) for c, a in zip(completions, answer)]

      with Trainer({"run.steps": 2, "run.eval_every": 0}, train_dataset=rows,
                   reward_fns=[exact]) as trainer:
          row = trainer.step()   # one RL step's metrics, e.g. row["reward/exact"]
    """

    def __init__(
        self,
        config: Config | str | Path | Mapping[str, Any] | None = None,
        *,
        model=None,
        tokenizer=None,
        train_dataset=None,
        eval_dataset=None,
        reward_fns: Sequence[str | Callable] | str | Callable | None = None,
        reward_weights: Sequence[float] | None = None,
        environment: Any = None,
    ):
        self.config = cfg = as_config(config)
        require_extras(cfg)
        use_persistent_cache(cfg.run.compile_cache)
        self.mesh, sample_mesh = split_meshes(cfg)
        self.parts: RunParts = build_run_parts(
            cfg,
            mesh=self.mesh,
            sample_mesh=sample_mesh,
            model=model,
            tokenizer=tokenizer,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            reward_fns=reward_fns,
            reward_weights=reward_weights,
            environment=environment,
        )
        try:
            self._start(cfg)
        except BaseException:
            self.parts.close()
            raise
        self._closed = False
        CompileCounter.install()
        if cfg.run.compile_ahead:
            self._compile_ahead()

    def _start(self, cfg: Config) -> None:
        """Update plan, compiled programs, train state (restored when resuming), logs."""
        parts, mesh = self.parts, self.mesh
        self.plan = plan = UpdatePlan.from_config(cfg)
        optimizer = make_optimizer(cfg.optim, total_updates=cfg.run.steps * plan.mini_batches)
        graphdef, params = nnx.split(parts.model, nnx.Param)
        self.state, _ = init_sharded_state(params, optimizer, mesh)
        self.checkpointer = Checkpointer(
            parts.run_dir / "checkpoints",
            keep_last=cfg.run.keep_last,
            best_metric=cfg.run.best_metric,
        )
        # The reference is the initial policy, also when resuming.
        self.ref_params = jax.tree.map(jnp.copy, self.state.params) if plan.reference else None
        # The newest intact checkpoint (damaged newer ones are named in a warning).
        start, self.state, host = self.checkpointer.restore_latest(self.state)
        self.partial = partial_buffer(cfg, host.get("partial") if start else None)
        # Asynchronous rollouts: the next step's rollout, running beside this step's update.
        self._ahead = RolloutsAhead() if cfg.rollout.async_devices else None
        if start and "pending_rollout" in host:
            self._restore_pending(start + 1, host["pending_rollout"])
        if start:
            parts.prompts.set_state(host["data"])
            log.info("resumed from %s at step %d", self.checkpointer.directory, start)
        self.step_count = self._saved_step = start
        self._writer = jax.process_index() == 0
        self.metrics_log = MetricsLog(
            parts.run_dir,
            enabled=self._writer,
            tensorboard=cfg.run.tensorboard,
            wandb=cfg.run.wandb,
            resume_step=start if start else -1,  # from scratch: no rows of an earlier attempt
            config=cfg.to_dict(),
        )
        if self._writer:
            text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
            (parts.run_dir / "config.yaml").write_text(text)
        self.updater = Updater(
            graphdef, optimizer, plan, mesh, seed=cfg.run.seed, placed_like=self.state
        )

    # -- the public surface ------------------------------------------------------------------

    @property
    def params(self):
        """The current parameters (an ``nnx.State`` of the policy's ``nnx.Param``)."""
        return self.state.params

    @property
    def model(self):
        """The policy with the current parameters (e.g. for ``save_pretrained``)."""
        nnx.update(self.parts.model, self.state.params)
        return self.parts.model

    @property
    def tokenizer(self):
        return self.parts.tokenizer

    @property
    def sampler(self):
        """The rollout sampler (engine, slots, pages: what the config or defaults chose)."""
        return self.parts.sampler

    @property
    def run_dir(self) -> Path:
        return self.parts.run_dir

    def step(self) -> dict[str, Any]:
        """Runs exactly one RL step (rollout, rewards, prepare, update, log, save when due).

        Returns:
          The step's metrics row, as written to ``metrics.jsonl``.
        """
        return self._step(stopping=False)

    def train(self) -> TrainResult:
        """Runs to ``run.steps`` (from the last checkpoint when resuming); SIGTERM-safe."""
        cfg, progress = self.config, None
        if self._writer and cfg.run.progress:
            progress = tqdm(
                total=cfg.run.steps, initial=self.step_count, desc="rl", dynamic_ncols=True
            )
        stopped = False
        with _StopFlag() as stop:
            while self.step_count < cfg.run.steps and not stopped:
                # The flag is read once per step, before its save decision: the step that
                # stops is the step that saves (a later SIGTERM is served after the next step).
                row = self._step(stopping=lambda: stop.requested)
                stopped = self._stopped
                if progress is not None:
                    loss = row.get("loss") or 0
                    progress.set_postfix(reward=f"{row['reward_mean']:.3f}", loss=f"{loss:.4f}")
                    progress.update(1)
        if progress is not None:
            progress.close()
        self.checkpointer.wait()
        plot_path = None
        if self._writer:
            plot_path = plot_runs([self.run_dir], self.run_dir / "learning_curve.png")
        return TrainResult(
            run_dir=self.run_dir,
            last_step=self.step_count,
            metrics_path=self.metrics_log.path,
            checkpoint_dir=self.checkpointer.directory,
            plot_path=plot_path,
            stopped_early=stopped,
        )

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation of the current policy (``eval/avg@1``, ...); not logged."""
        if not self.parts.eval_prompt_ids:
            raise ConfigError("no held-out prompts: pass eval_dataset= or set data.eval_source")
        return self.parts.evaluate(self._sampling_params(), self.step_count)

    def save(self) -> Path:
        """Checkpoints the current state (at the current step); returns the checkpoint folder."""
        if self._saved_step != self.step_count or self.checkpointer.latest_step() is None:
            self._save(self.step_count, {})
        self.checkpointer.wait()
        return self.checkpointer.directory / str(self.step_count)

    def close(self) -> None:
        """Waits for pending saves and stops the reward workers (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._ahead is not None:
            self._ahead.close()
        self.checkpointer.close()
        self.parts.close()
        self.metrics_log.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one step ------------------------------------------------------------------------------

    def _step(self, stopping: bool | Callable[[], bool]) -> dict[str, Any]:
        if self._closed:
            raise RuntimeError("the trainer is closed")
        cfg = self.config
        if self.step_count >= cfg.run.steps:
            raise ConfigError(
                f"run.steps={cfg.run.steps} reached: raise run.steps to train further"
            )
        if cfg.run.eval_every and self.step_count == 0:
            # The starting point of the learning curve: the policy before any RL update.
            compiles = CompileCounter.snapshot()
            row = self.parts.evaluate(self._sampling_params(), 0)
            self.metrics_log.log(0, {**row, **CompileCounter.since(compiles)})
        step = self.step_count + 1
        t_step, compiles = time.perf_counter(), CompileCounter.snapshot()
        rollout, lag = self._rollout_for(step)
        if self._ahead is not None and step < cfg.run.steps:  # the next one, beside the update
            ahead = functools.partial(self._rollout, lag=1)  # trained after this update
            self._ahead.start(step + 1, ahead, self._sampling_params())
        t_update, compiling = time.perf_counter(), CompileCounter.seconds
        batch, metrics = self.updater.prepare(rollout, step, self.state.params, self.ref_params)
        if self._ahead is not None:
            metrics["rollout/policy_lag"] = lag
        self.state, update_metrics = self.updater.update(self.state, batch)
        metrics.update(update_metrics)
        metrics["time/update"] = _without_compiles(t_update, compiling)
        self._stopped = stopping() if callable(stopping) else stopping
        row = self._finish(step, metrics, t_step, compiles, self._stopped)
        self.step_count = step
        return row

    def _compile_ahead(self) -> None:
        """``run.compile_ahead``: the train step at every shape of rows a step can meet (one;
        ``bucketed``: each bucket), into the persistent cache, and the rollout engine's programs
        (:func:`warm_up_rollout`), before the first step. Multi-turn and speculative engines
        compile theirs in the first rollout."""
        cfg, parts = self.config, self.parts
        start, before = time.perf_counter(), CompileCounter.snapshot()
        log.info("compiling ahead: the update at every shape of rows, the rollout's engine")
        self.updater.compile_ahead(
            self.state, self._stand_in, self.state.params, self.ref_params, log=log.info
        )
        requests = 0
        if parts.episodes is None and not parts.sampler.speculate:
            requests = warm_up_rollout(
                parts.sampler,
                self._sampling_params(),
                cfg.rollout.prompts_per_step * (1 + cfg.rollout.over_provision),
                cfg.rollout.samples_per_prompt,
                (parts.prompt_len, cfg.rollout.max_new_tokens),
                return_hidden=self.plan.coefficients == "sampler",
                **self._sampling(),
            )
        done, seconds = CompileCounter.since(before), time.perf_counter() - start
        compiled, loaded = done["compiles"], done["compiles_loaded"]
        log.info(
            f"compiled ahead: {compiled} programs ({loaded} loaded from the cache), "
            f"{requests} warm-up requests, in {seconds:.1f} s"
        )

    def _stand_in(self, lengths: np.ndarray) -> Rollout:
        """A rollout of the run's shapes and placement with response ``lengths`` (zeros
        otherwise): what :meth:`Updater.compile_ahead` runs the update's programs on."""
        cfg, parts, plan = self.config, self.parts, self.plan
        B, P, G = plan.rows, parts.prompt_len, cfg.rollout.max_new_tokens
        hidden = (B, G, parts.model.config.hidden_size)
        arrays = {
            "sequences": np.zeros((B, P + G), np.int32),
            "rollout_logprobs": np.zeros((B, G), np.float32),
            "hidden": np.zeros(hidden, parts.model.dtype)
            if plan.coefficients == "sampler"
            else None,
            "action_mask": np.ones((B, G), bool) if parts.episodes is not None else None,
        }
        zeros = np.zeros(B, np.float32)
        return Rollout(
            **sh.replicated_to_global(arrays, self.mesh, row_axis=0),
            prompt_lengths=np.full(B, P, np.int32),
            lengths=lengths,
            rewards=zeros,
            advantages=zeros,
            records=[],
            responses=[],
            stats={},
        )

    def _sampling(self) -> dict[str, Any]:
        """The rollout's sampling settings (``Sampler.generate`` keywords)."""
        r = self.config.rollout
        return dict(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=self.parts.stop_token_ids,
        )

    @functools.cached_property
    def _rollout_spec(self) -> RolloutSpec:
        """What every rollout batch of the run is (from the config, once)."""
        cfg = self.config
        return RolloutSpec(
            n=cfg.rollout.samples_per_prompt,
            prompt_len=self.parts.prompt_len,
            gen_len=cfg.rollout.max_new_tokens,
            sampling=self._sampling(),
            advantage=cfg.algo.advantage,
            overlong=(cfg.reward.overlong_buffer, cfg.reward.overlong_factor),
            dynamic_rounds=cfg.rollout.dynamic_sampling_rounds,
            return_hidden=self.plan.coefficients == "sampler",
        )

    def _rollout_for(self, step: int) -> tuple[Rollout, int]:
        """Step ``step``'s rollout and how many updates behind its policy is: sampled now with
        the current parameters (0), or (asynchronous rollouts) the one that ran beside the last
        update, with the parameters before it (1)."""
        rollout = None if self._ahead is None else self._ahead.take(step)
        return (self._rollout(step), 0) if rollout is None else (rollout, 1)

    def _restore_pending(self, step: int, saved) -> None:
        """The rollout a checkpoint saved in flight, as step ``step``'s (dropped, with a
        warning, when the run is not asynchronous any more)."""
        if self._ahead is None:
            log.warning("the checkpoint's rollout in flight is dropped: rollout.async_devices=0")
            return
        rollout = rollout_from_host(unpack(saved))
        moved = sh.replicated_to_global(
            {k: getattr(rollout, k) for k in DEVICE_FIELDS}, self.mesh, row_axis=0
        )
        self._ahead.restore(step, dataclasses.replace(rollout, **moved))

    def _rollout(self, step: int, params=None, lag: int = 0) -> Rollout:
        """Sample and score step ``step``'s rollout batch with ``params`` (in the sampler's
        layout; default: the current parameters), ``lag`` updates before the update that
        trains it (an asynchronous run's rollout ahead: 1)."""
        cfg, parts, spec = self.config, self.parts, self._rollout_spec
        rollout = collect_rollout(
            sampler=parts.sampler,
            params=self._sampling_params() if params is None else params,
            scorer=parts.scorer,
            tokenizer=parts.tokenizer,
            prompt_batches=parts.prompts,
            spec=spec,
            seed=cfg.run.seed * 1_000_003 + step,
            episodes=parts.episodes,
            partial=self.partial,
            clock=Clock(version=step - 1 - lag, lag=lag),  # RL steps applied to ``params``
        )
        # Back from the sampler's mesh to the trainer's rows (a no-op when the layouts agree).
        moved = sh.replicated_to_global(
            {k: getattr(rollout, k) for k in DEVICE_FIELDS}, self.mesh, row_axis=0
        )
        return dataclasses.replace(rollout, **moved)

    def _sampling_params(self):
        """The trainer's parameters in the sampler's layout: its mesh, the compute dtype."""
        return sh.reshard_for_sampling(
            self.state.params,
            self.mesh,
            sample_mesh=self.parts.sampler.mesh,
            dtype=self.parts.model.dtype,
        )

    def _finish(self, step, metrics, t_step, compiles, stopping: bool) -> dict[str, Any]:
        """Evaluate when due, log the step's metrics, save when due; returns the logged row."""
        cfg = self.config
        if cfg.run.eval_every and step % cfg.run.eval_every == 0:
            if self._ahead is not None:
                self._ahead.wait()  # one sampler call at a time
            t_eval, compiling = time.perf_counter(), CompileCounter.seconds
            metrics.update(self.parts.evaluate(self._sampling_params(), step))
            metrics["time/eval"] = _without_compiles(t_eval, compiling)
        metrics["time/step"] = time.perf_counter() - t_step
        metrics.update(CompileCounter.since(compiles))
        row = self.metrics_log.log(step, metrics)
        if cfg.run.save_due(step, stopping):
            self._save(step, row)
        return row

    def _save(self, step: int, row: dict[str, Any]) -> None:
        # The rollout in flight is the next step's: kept whole, the prompts it read are gone.
        pending = None if self._ahead is None else self._ahead.wait()
        self.checkpointer.save(
            step,
            self.state,
            host={
                "data": self.parts.prompts.get_state(),
                "step": step,
                "seed": self.config.run.seed,
                **({} if self.partial is None else {"partial": self.partial.to_json()}),
                **({} if pending is None else {"pending_rollout": pack(rollout_to_host(pending))}),
            },
            metrics={k: v for k, v in row.items() if isinstance(v, int | float)},
        )
        self._saved_step = step


def _without_compiles(start: float, compiling: float) -> float:
    """Seconds since ``start`` less those spent compiling since (``CompileCounter.seconds`` was
    ``compiling``): ``time/rollout``, ``time/update`` and ``time/eval`` leave the compiles to
    ``time/compile``; ``time/step`` is the whole step."""
    return time.perf_counter() - start - (CompileCounter.seconds - compiling)


def train(config: Config | str | Path | Mapping[str, Any]) -> TrainResult:
    """Runs (or resumes) the RL job described by ``config``; returns where its outputs are."""
    with Trainer(config) as trainer:
        return trainer.train()
