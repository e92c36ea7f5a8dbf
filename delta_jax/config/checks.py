"""Cross-field checks of a run configuration (what single field types cannot express) and of its
ranged fields."""

from __future__ import annotations

import dataclasses

from delta_jax.config.sections import (
    SECTIONS,
    AlgoConfigSection,
    Config,
    ConfigError,
    DataConfigSection,
)


def validate(config: Config) -> None:
    """Cross-field checks that single field types cannot express."""
    r, a, run, d = config.rollout, config.algo, config.run, config.data
    _check_ranges(config)
    _check_gym(d)
    if d.answer_marker is not None and config.reward.kind != "reasoning_gym":
        raise ConfigError(
            f"data.answer_marker={d.answer_marker!r} is read by reward.kind=reasoning_gym "
            f"(reward.kind={config.reward.kind})"
        )
    if d.min_working_words and d.answer_marker is None:
        raise ConfigError(
            f"data.min_working_words={d.min_working_words} counts the words before "
            "data.answer_marker: set data.answer_marker"
        )
    if config.model.path == "demo:tiny" and d.source in ("demo:arithmetic", "demo:products"):
        if (d.demo_template == "tool") != (d.source == "demo:products"):
            raise ConfigError(
                f"data.demo_template={d.demo_template} does not fit data.source={d.source} "
                "(demo:products goes with the tool template, demo:arithmetic with short / long)"
            )
    if d.extra_eval_sources and not run.eval_every:
        raise ConfigError(
            "data.extra_eval_sources are evaluated every run.eval_every steps: set run.eval_every"
        )
    if r.environment and r.engine != "continuous":
        raise ConfigError(
            f"rollout.environment={r.environment!r} needs rollout.engine=continuous (a turn "
            "waits for its observation without holding the batch)"
        )
    _check_partial(config)
    if r.engine == "continuous" and r.samples_per_prompt > r.decode_slots:
        raise ConfigError(
            f"rollout.samples_per_prompt={r.samples_per_prompt} exceeds "
            f"rollout.decode_slots={r.decode_slots}"
        )
    if config.reward.overlong_buffer > r.max_new_tokens:
        raise ConfigError(
            f"reward.overlong_buffer={config.reward.overlong_buffer} must be <= "
            f"rollout.max_new_tokens={r.max_new_tokens} (the punished tail of a response)"
        )
    rows = r.prompts_per_step * r.samples_per_prompt
    if rows % a.mini_batches:
        raise ConfigError(
            f"algo.mini_batches={a.mini_batches} must divide the rollout batch "
            f"({r.prompts_per_step} prompts x {r.samples_per_prompt} samples = {rows} rows)"
        )
    if (rows // a.mini_batches) % a.micro_batches:
        raise ConfigError(
            f"algo.micro_batches={a.micro_batches} must divide the mini-batch "
            f"({rows // a.mini_batches} rows)"
        )
    clip_keys = ("clip_eps_low", "clip_eps_high", "dual_clip_c")
    changed = [k for k in clip_keys if getattr(a, k) != getattr(AlgoConfigSection(), k)]
    if a.loss == "sapo" and changed:
        raise ConfigError(
            f"algo.{changed[0]}={getattr(a, changed[0])} does not apply to algo.loss=sapo "
            "(a soft gate, no clip range)"
        )
    if a.lam_min > a.lam_max:
        raise ConfigError(f"algo.lam_min={a.lam_min} > algo.lam_max={a.lam_max}: need min <= max")
    budget = rows // a.mini_batches // a.micro_batches
    if isinstance(a.micro_batch_rows, int) and not 1 <= a.micro_batch_rows <= budget:
        raise ConfigError(
            f"algo.micro_batch_rows={a.micro_batch_rows} must be in [1, {budget}] (the "
            "mini-batch's rows / algo.micro_batches)"
        )
    if a.share_prompts is True and not a.packing:
        raise ConfigError("algo.share_prompts=true needs algo.packing=true (shared in packed rows)")
    longest = config.data.max_prompt_length + r.max_new_tokens - 1
    if a.tokens_per_row is not None and a.tokens_per_row < longest:
        raise ConfigError(
            f"algo.tokens_per_row={a.tokens_per_row} must hold the longest sequence "
            f"(data.max_prompt_length + rollout.max_new_tokens - 1 = {longest})"
        )
    if r.samples_per_prompt < 2 and a.advantage in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        raise ConfigError(
            f"rollout.samples_per_prompt={r.samples_per_prompt}: group advantages need >= 2 samples"
        )


def _check_partial(config: Config) -> None:
    """Partial and asynchronous rollouts need the importance weights; partial rollouts the
    continuous engine; ``max_staleness`` applies to them only."""
    r = config.rollout
    if r.async_devices:
        if r.over_provision and r.max_staleness == 0:
            raise ConfigError(
                f"rollout.async_devices={r.async_devices} with rollout.max_staleness=0: every "
                "token of an asynchronous run is one update old (set max_staleness >= 1)"
            )
        if config.algo.tis_cap is None:
            raise ConfigError(
                f"rollout.async_devices={r.async_devices} needs algo.tis_cap (every token is "
                "drawn one update behind and weighted against that policy)"
            )
    if not r.over_provision:
        if r.max_staleness is not None:
            raise ConfigError(
                f"rollout.max_staleness={r.max_staleness} bounds partial rollouts: set "
                "rollout.over_provision >= 1 too"
            )
        return
    need = [
        (r.engine != "continuous", "rollout.engine=continuous (it stops and continues rows)"),
        (
            config.algo.tis_cap is None,
            "algo.tis_cap (tokens drawn by an older policy are weighted against it)",
        ),
    ]
    for failed, what in need:
        if failed:
            raise ConfigError(f"rollout.over_provision={r.over_provision} needs {what}")


def _check_ranges(config: Config) -> None:
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(config, section)):
            value = getattr(getattr(config, section), f.name)
            if "range" not in f.metadata or value is None:
                continue
            lo, hi, bounds = f.metadata["range"]
            low_ok = value >= lo if bounds[0] == "[" else value > lo
            high_ok = hi is None or (value <= hi if bounds[1] == "]" else value < hi)
            if not (low_ok and high_ok):
                if hi is None:
                    bound = f">= {lo}" if bounds[0] == "[" else f"> {lo}"
                else:
                    bound = f"in {bounds[0]}{lo}, {hi}{bounds[1]}"
                raise ConfigError(f"{section}.{f.name}={value} must be {bound}")
    mesh = config.run.mesh
    if mesh.count(-1) > 1 or any(m == 0 or m < -1 for m in mesh):
        raise ConfigError(
            f"run.mesh={list(mesh)}: each entry must be >= 1, or -1 (the remaining devices) "
            "for at most one"
        )


GYM_PREFIX = "reasoning_gym:"  # delta_jax.data.gym.GYM_PREFIX (not imported: it loads `datasets`)


def _check_gym(d: DataConfigSection) -> None:
    """The gym keys are read only with a reasoning_gym: source, and the tasks and options they
    name exist (checked by reasoning-gym itself, so a typo fails at load, not at setup)."""
    train_gym = d.source.startswith(GYM_PREFIX)
    eval_gym = any(
        s is not None and s.startswith(GYM_PREFIX)
        for s in (d.eval_source, *(d.extra_eval_sources or ()))
    )
    defaults = DataConfigSection()
    unused = [
        (key, needs)
        for key, needs, idle in (
            ("gym_options", "data.source", not train_gym),
            ("answer_marker", "data.source", not train_gym),
            ("gym_size", "data.source", not train_gym),
            ("gym_seed", "data.source or a held-out source", not (train_gym or eval_gym)),
        )
        if idle and getattr(d, key) != getattr(defaults, key)
    ]
    if unused:
        key, needs = unused[0]
        raise ConfigError(
            f"data.{key}={getattr(d, key)!r} is read only with a reasoning_gym:<task> {needs} "
            f"(data.source={d.source})"
        )
    if not (train_gym or eval_gym):
        return
    # Lazy: delta_jax.data.gym loads `datasets` (seconds); only gym sources need it.
    from delta_jax.data.gym import check_task, eval_gym_options, gym_task

    sources = [("data.source", d.source), ("data.eval_source", d.eval_source)]
    sources += [("data.extra_eval_sources", s) for s in d.extra_eval_sources or ()]
    for key, source in sources:
        try:
            if source is not None and source.startswith(GYM_PREFIX):
                options = d.gym_options if key == "data.source" else eval_gym_options(d, source)
                check_task(gym_task(source), options)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"{key}={source}: {e}") from None
