"""The rollout side's state between RL steps: the devices it samples on, the partial-rollout
buffer, and the rollout in flight of an asynchronous run.

* :func:`split_meshes`: with ``rollout.async_devices=k`` the first ``k`` devices sample on their
  own mesh and ``run.mesh`` spans the others (the trainer's);
* :func:`partial_buffer`: the buffer of ``rollout.over_provision``, empty or as a checkpoint
  saved it (:mod:`delta_jax.rl.partial`);
* :class:`RolloutsAhead`: asynchronous rollouts. Step ``t`` starts step ``t + 1``'s rollout
  with the parameters it is about to update (their copy on the sampler's devices) and then
  updates: the rollout's device programs run on the sampler's mesh while the update's run on
  the trainer's, and the engine's scheduler (host code) runs on a background thread. Step
  ``t + 1`` takes that rollout (drawn one update behind) and starts the next. One rollout is
  in flight at a time; the trainer waits for it before an evaluation (one sampler call at a
  time) and before a save, which keeps it whole in the checkpoint (the prompts it read are
  gone from the prompt source), so a resumed run goes on exactly.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax

from delta_jax import sharding as sh
from delta_jax.config import Config, ConfigError
from delta_jax.rl.partial import PartialRollouts
from delta_jax.rl.rollout import Rollout

log = logging.getLogger(__name__)

__all__ = ["InlineRollouts", "RolloutsAhead", "partial_buffer", "split_meshes"]


def split_meshes(cfg: Config):
    """The trainer's mesh and the sampler's devices' mesh (None: the trainer's devices).

    With several processes each gives the sampler the same number of its own devices (its
    first ``k / processes``): the sampler's programs span the processes, and every process runs
    the rollout's host code (the same in each, as in a synchronous run)."""
    k = cfg.rollout.async_devices
    if not k:
        return sh.mesh_from_config(cfg.run.mesh), None
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    processes = jax.process_count()
    if k % processes:
        raise ConfigError(
            f"rollout.async_devices={k} must be a multiple of the {processes} processes "
            "(each gives the sampler as many of its devices)"
        )
    if k >= len(devices):
        raise ConfigError(
            f"rollout.async_devices={k} leaves no device to train on ({len(devices)} devices)"
        )
    share, local = k // processes, len(devices) // processes  # devices sorted by process
    sample = [d for i, d in enumerate(devices) if i % local < share]
    train = [d for i, d in enumerate(devices) if i % local >= share]
    try:
        train_mesh = sh.make_mesh(*cfg.run.mesh, devices=train)
    except ValueError as e:
        raise ConfigError(f"run.mesh over the {len(train)} training devices: {e}") from None
    return train_mesh, sh.make_mesh(devices=sample)


def partial_buffer(cfg: Config, saved) -> PartialRollouts | None:
    """The partial-rollout buffer of ``rollout.over_provision`` (None: off): empty, or as a
    checkpoint saved it (``saved``: its JSON state; None when it had none)."""
    r = cfg.rollout
    if not r.over_provision:
        if saved is not None:
            log.warning("the checkpoint's partial groups are dropped: rollout.over_provision=0")
        return None
    extra = r.over_provision * r.prompts_per_step
    fresh = PartialRollouts(r.samples_per_prompt, r.prompts_per_step, extra, r.max_staleness)
    if saved is None:
        return fresh
    buffer = PartialRollouts.from_json(saved)
    if (buffer.n, buffer.groups, buffer.extra) != (fresh.n, fresh.groups, fresh.extra):
        raise ConfigError(
            f"the checkpoint's partial rollouts had {buffer.groups} groups of {buffer.n} and "
            f"{buffer.extra} more per call; the config asks for {fresh.groups} of {fresh.n} "
            f"and {fresh.extra}: resume with the same rollout.prompts_per_step, "
            "samples_per_prompt and over_provision"
        )
    buffer.max_staleness = r.max_staleness
    return buffer


class InlineRollouts:
    """Runs each rollout when it is started: an asynchronous run's schedule (each step's
    rollout drawn one update behind) without the overlap; as :data:`ROLLOUT_EXECUTOR`, the
    reference an overlapped run must equal."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # held, as a thread's future would hold it
            future.set_exception(e)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass


# What runs an asynchronous run's rollouts: one background thread.
ROLLOUT_EXECUTOR = functools.partial(ThreadPoolExecutor, 1, "rollout")


class RolloutsAhead:
    """The rollout in flight of an asynchronous run (see the module docstring)."""

    def __init__(self):
        self._executor = ROLLOUT_EXECUTOR()
        if jax.process_count() > 1 and jax.devices()[0].platform == "cpu":
            # The CPU's cross-process collectives (gloo) share one channel between two processes:
            # two programs' collectives at once (the update's, the sampler's) would interleave.
            log.warning("asynchronous rollouts across CPU processes run inline (no overlap)")
            self._executor = InlineRollouts()
        self._pending: tuple[int, Future] | None = None

    def start(self, step: int, rollout_fn, params) -> None:
        """Starts ``rollout_fn(step, params)``, step ``step``'s rollout."""
        if self._pending is not None:
            raise RuntimeError("a rollout is in flight already")
        self._pending = (step, self._executor.submit(rollout_fn, step, params))

    def restore(self, step: int, rollout: Rollout) -> None:
        """``rollout`` (a checkpoint's) as step ``step``'s, ended."""
        future: Future = Future()
        future.set_result(rollout)
        self._pending = (step, future)

    def take(self, step: int) -> Rollout | None:
        """Step ``step``'s rollout once it has ended (None: none in flight), with the seconds
        the caller waited for it as ``time/rollout_wait``."""
        if self._pending is None:
            return None
        (due, future), self._pending = self._pending, None
        if due != step:
            raise RuntimeError(f"the rollout in flight is step {due}'s, not step {step}'s")
        start = time.perf_counter()
        rollout = future.result()
        rollout.stats["time/rollout_wait"] = time.perf_counter() - start
        return rollout

    def wait(self) -> Rollout | None:
        """The rollout in flight, once it has ended; it stays in flight (None: none is)."""
        return None if self._pending is None else self._pending[1].result()

    def close(self) -> None:
        """Waits for the rollout in flight, then stops the thread."""
        self._executor.shutdown(wait=True)
