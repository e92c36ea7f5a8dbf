"""Assemble the parts of a run: model, tokenizer, prompts, sampler, rewards, environments.

Each part is built from the config unless the caller passes it as an object
(:class:`~delta_jax.rl.Trainer`'s keywords): a loaded model, a tokenizer, a data set object,
reward callables, an environment. The prompt sets themselves are data work
(:mod:`delta_jax.data.prompt_sets`); here the config's values are handed to it and its
mistakes reported as configuration errors.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from delta_jax import distributed
from delta_jax import sharding as sh
from delta_jax.checkpoint import Checkpointer
from delta_jax.config import Config, ConfigError, load_config
from delta_jax.data import EncodedPrompts, PromptRecord
from delta_jax.data import prompt_sets as prompt_data
from delta_jax.data.gym import GYM_ENTRY
from delta_jax.data.objects import StreamPrompts
from delta_jax.data.prompt_sets import IndexedPrompts, PromptSetError
from delta_jax.demo import warm_up_demo_model
from delta_jax.envs import PythonTool
from delta_jax.envs.episodes import (
    EnvironmentFailure,
    EpisodeRunner,
    as_factory,
    check_text,
    episode_row,
    error_line,
)
from delta_jax.eval import EvalSampling, evaluate_prompts
from delta_jax.models import Transformer, from_pretrained, load_tokenizer, lora, resolve_model_dir
from delta_jax.rewards import FlippedRewards, RewardSet
from delta_jax.rewards.custom import load_callable
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.sampling import Sampler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEMO_MODEL = "demo:tiny"


@dataclasses.dataclass
class RunParts:
    """Everything the loop needs besides the train state and the update plan."""

    config: Config
    run_dir: Path
    model: Transformer
    tokenizer: PreTrainedTokenizerBase
    sampler: Sampler
    scorer: RewardSet | FlippedRewards  # training rewards (noisy if reward.flip_fraction > 0)
    eval_scorer: RewardSet  # the verifier itself
    prompts: IndexedPrompts | StreamPrompts  # the training batches, checkpointable
    eval_prompt_ids: list[list[int]]
    eval_records: list[PromptRecord]
    prompt_len: int
    stop_token_ids: tuple[int, ...]
    episodes: EpisodeRunner | None = None  # multi-turn: the environments (None: one turn)
    # data.extra_eval_sources: encoded held-out sets by name, reported as eval_<name>/...
    extra_evals: dict[str, Any] = dataclasses.field(default_factory=dict)

    def evaluate(self, params, step: int) -> dict[str, float]:
        """Mean reward on the held-out prompts (the sampling settings of the run), then on
        each extra held-out set under its own prefix."""
        cfg = self.config
        sampling = EvalSampling(
            k=1,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            seed=cfg.run.seed * 31 + step,
            stop_token_ids=self.stop_token_ids,
            batch_prompts=None,
        )
        held_out = EncodedPrompts(self.eval_prompt_ids, self.eval_records, dropped=0)
        sets = [("eval/", held_out)]
        sets += [(f"eval_{name}/", s) for name, s in self.extra_evals.items()]
        metrics: dict[str, float] = {}
        for prefix, prompts in sets:
            metrics |= evaluate_prompts(
                sampler=self.sampler,
                params=params,
                scorer=self.eval_scorer,
                tokenizer=self.tokenizer,
                prompts=prompts,
                sampling=sampling,
                prefix=prefix,
                episodes=self.episodes,
            )
        return metrics

    def close(self) -> None:
        self.eval_scorer.close()  # the training scorer wraps the same pools
        if self.episodes is not None:
            self.episodes.close()


def special_token_ids(tokenizer, model) -> tuple[int, tuple[int, ...]]:
    """``(pad id, stop ids)`` of a policy: the tokenizer's and the model config's EOS ids."""
    stop = {tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None)}
    stop_ids = tuple(sorted(int(s) for s in stop if isinstance(s, int | np.integer)))
    pad = tokenizer.pad_token_id
    return (pad if pad is not None else 0), stop_ids


def demo_model_dir(config: Config, run_dir: Path) -> Path:
    """The demo model's directory in the run: warmed up once, by process 0 (the others load
    what it saved); a resumed run finds it there."""
    m, path = config.model, run_dir / "demo_model"
    if distributed.is_main_process():
        warm_up_demo_model(
            path,
            steps=m.demo_warmup_steps,
            lr=m.demo_warmup_lr,
            noise=m.demo_warmup_noise,
            seed=config.run.seed,
            target_accuracy=m.demo_warmup_target,
            template=config.data.demo_template,
        )
    distributed.barrier("demo-model")
    return path


def load_model(config: Config, run_dir: Path, *, model=None, tokenizer=None):
    """The run's policy and tokenizer: the objects given, else built from ``config.model``.

    ``model.path`` names a directory, a hub id (downloaded once), a ``.gguf`` file or the demo
    model (warmed up once, :func:`demo_model_dir`). A given model is used as it is, except that
    ``model.lora_rank > 0`` adds adapters to one that has none (what the config would build).
    """
    m = config.model
    if model is not None and tokenizer is None and m.path == DEMO_MODEL:
        raise ConfigError(
            "model= was given without tokenizer=: pass its tokenizer, or set model.path to the "
            "directory or hub id it was loaded from"
        )
    path: str | Path = m.path
    if m.path == DEMO_MODEL and model is None:
        path = demo_model_dir(config, run_dir)
    if model is None or tokenizer is None:
        path = resolve_model_dir(str(path), revision=m.revision)  # a hub id: downloaded once
    if model is None:
        model = from_pretrained(
            str(path),
            dtype=jnp.dtype(m.dtype),
            param_dtype=jnp.dtype(m.param_dtype),
            scan_layers=m.scan_layers,
            remat=m.remat,
            attention=m.attention,
            attention_block=m.attention_block,
        )
    if m.lora_rank and not model.config.lora_rank:
        lora.add_adapters(
            model,
            rank=m.lora_rank,
            alpha=m.lora_alpha,
            targets=m.lora_targets,
            seed=config.run.seed,
        )
    tokenizer = load_tokenizer(str(path)) if tokenizer is None else tokenizer
    if len(tokenizer) > model.config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has "
            f"{model.config.vocab_size} rows: resize the model's embeddings to the tokenizer"
        )
    return model, tokenizer


def restore_policy(run_dir: Path, step: int | None):
    """The policy model of a run, with parameters from its checkpoint (latest by default).

    Read-only: nothing in the run is moved or written. Without ``step``, damaged newer steps
    are skipped for the newest intact one, named in one warning line and left in place (a
    training run resuming later moves them aside); a damaged ``step`` is a one-line error.
    """
    config = load_config(run_dir / "config.yaml")
    model, tokenizer = load_model(config, run_dir)
    ckpt = Checkpointer(run_dir / "checkpoints", read_only=True)
    _, params = nnx.split(model, nnx.Param)
    state = init_train_state(params, make_optimizer(config.optim, total_updates=1))
    if step is None:
        step, state, _ = ckpt.restore_latest(state)
    else:
        state, _ = ckpt.restore(step, state)
    if not step:
        raise ConfigError(f"{run_dir}: no checkpoint found under {run_dir / 'checkpoints'}")
    ckpt.close()
    nnx.update(model, state.params)
    return model, tokenizer, step


def _first_turn(episodes: EpisodeRunner, record) -> str:
    """A record's first user turn: a fresh environment's ``reset`` on its row.

    Raises:
      ConfigError: (one line) the environment failed, or gave something other than text.
    """
    env = None
    try:
        env = episodes.call(episodes.factory, "the factory")  # within its deadline
        first = episodes.call(lambda: env.reset(episode_row(record)), "reset")
        return check_text(first, "reset's first user turn")
    except EnvironmentFailure as e:
        name = episodes.env_name if env is None else type(env).__name__
        raise ConfigError(f"environment {name}: {e}") from None
    except Exception as e:
        name = episodes.env_name if env is None else type(env).__name__
        where = "factory" if env is None else "reset"
        raise ConfigError(f"environment {name}: {where} failed: {error_line(e)}") from e


def episode_hooks(episodes: EpisodeRunner | None) -> dict[str, Any]:
    """The prompt functions' environment arguments (none for one-turn runs): a record's prompt
    is the first user turn a fresh environment's ``reset`` gives, and the chat template
    declares the environment's tools."""
    if episodes is None:
        return {}
    return {"first_turn": functools.partial(_first_turn, episodes), "tools": episodes.tools}


def prompt_sets(config: Config, tokenizer, train_dataset=None, eval_dataset=None, episodes=None):
    """The training batches and the held-out prompts (None without an eval source), from
    ``config.data`` (:func:`delta_jax.data.prompt_sets.prompt_sets`)."""
    run = config.run
    try:
        train, evals = prompt_data.prompt_sets(
            config.data,
            tokenizer,
            batch_size=config.rollout.prompts_per_step,
            seed=run.seed,
            eval_prompts=run.eval_prompts,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            **episode_hooks(episodes),
        )
    except PromptSetError as e:
        raise ConfigError(str(e)) from None
    if run.eval_every and evals is None:
        raise ConfigError(
            f"run.eval_every={run.eval_every} needs held-out prompts: pass eval_dataset=, "
            "set data.eval_source, or set run.eval_every=0"
        )
    return train, evals


def extra_eval_sets(config: Config, tokenizer, episodes=None) -> dict[str, Any]:
    """``data.extra_eval_sources`` by metric name (``eval_<name>/``): encoded held-out sets."""
    try:
        return prompt_data.extra_eval_sets(
            config.data,
            tokenizer,
            seed=config.run.seed,
            eval_prompts=config.run.eval_prompts,
            **episode_hooks(episodes),
        )
    except PromptSetError as e:
        raise ConfigError(str(e)) from None


def check_gym_entries(kinds, train, evals) -> None:
    """The ``reasoning_gym`` reward kind scores against each record's entry: prompts that carry
    none (a file, a list of dicts) are a configuration error now, not at the first reward.
    ``kinds``: ``reward.kind`` or ``reward_fns``; a stream's records are not known yet."""
    kinds = [kinds] if isinstance(kinds, str) or callable(kinds) else list(kinds)
    if "reasoning_gym" not in kinds:
        return
    held_out = evals.records if evals else None
    for what, records in (("training", getattr(train, "records", None)), ("held-out", held_out)):
        if records and GYM_ENTRY not in records[0].extra:
            raise ConfigError(
                f"the reasoning_gym reward needs reasoning-gym prompts, but the {what} prompts "
                f"({records[0].source}) carry no {GYM_ENTRY!r}: use data.source: "
                "reasoning_gym:<task> or a reasoning_gym data set object"
            )


def episode_runner(config: Config, tokenizer, stop_ids, environment=None):
    """The run's environments (``environment=`` or ``rollout.environment``), or None (one turn).

    ``python_tool`` is :class:`~delta_jax.envs.PythonTool` with the ``rollout`` keys: call
    format, ``max_turns - 1`` tool calls, ``max_observation_tokens``, ``tool_timeout_s``.
    """
    r = config.rollout
    if environment is None and not r.environment:
        if r.max_turns > 1:
            raise ConfigError(
                f"rollout.max_turns={r.max_turns} needs an environment: set rollout.environment "
                "(e.g. python_tool) or pass environment="
            )
        return None
    if r.engine != "continuous":
        raise ConfigError("an environment needs rollout.engine=continuous")
    if jax.process_count() > 1:
        # Each process would step its own environments: the hosts' answers arrive at
        # different times, and the engine's schedule (which programs run) would differ.
        raise ConfigError(
            f"multi-turn rollouts run on one host for now (this run has {jax.process_count()} "
            "processes): drop rollout.environment / environment="
        )
    # A hang past rollout.tool_timeout_s ends its episode; python_tool bounds its own calls
    # with it (a timeout there is an observation, and the episode goes on).
    deadline = r.tool_timeout_s
    try:
        if environment is not None:
            factory = as_factory(environment, tokenizer)
            deadline = None if isinstance(environment, PythonTool) else deadline
        elif r.environment == "python_tool":
            deadline = None
            chat = bool(getattr(tokenizer, "chat_template", None))
            fmt = r.tool_call_format
            factory = functools.partial(
                PythonTool,
                call_format=("tool_call" if chat else "fenced") if fmt == "auto" else fmt,
                max_tool_calls=r.max_turns - 1,
                max_observation_tokens=r.max_observation_tokens,
                tokenizer=tokenizer,
                timeout_s=r.tool_timeout_s,
            )
        else:
            factory = load_callable(r.environment, "environment")
        return EpisodeRunner(
            factory,
            tokenizer,
            max_turns=r.max_turns,
            max_observation_tokens=r.max_observation_tokens,
            end_ids=stop_ids,
            workers=max(2, min(16, r.decode_slots)),
            timeout_s=deadline,
        )
    except (ValueError, TypeError) as e:
        where = "environment" if environment is not None else "rollout.environment"
        raise ConfigError(f"{where}: {e}") from None


def make_scorers(
    config: Config,
    reward_fns: Sequence[str | Callable] | str | Callable | None = None,
    reward_weights: Sequence[float] | None = None,
) -> tuple[RewardSet | FlippedRewards, RewardSet]:
    """(training scorer, evaluation scorer): the same rewards, noisy for training only.

    ``reward_fns`` replaces ``reward.kind``: kinds, ``"module:function"`` paths or batched
    callables, summed with ``reward_weights``.
    """
    r = config.reward
    fns = r.kind if reward_fns is None else reward_fns
    try:
        # Every call passes the rows' answer and tests (rl.rollout, eval): a batched function
        # that cannot take them is refused now.
        scorer = RewardSet(
            fns,
            reward_weights,
            num_workers=r.num_workers,
            timeout_s=r.timeout_s,
            columns=("answer", "tests"),
        )
    except (ValueError, ImportError) as e:
        raise ConfigError(f"reward: {e}") from None
    if r.flip_fraction > 0:
        return FlippedRewards(scorer, r.flip_fraction, config.run.seed), scorer
    return scorer, scorer


def build_run_parts(
    config: Config,
    mesh=None,
    *,
    sample_mesh=None,
    model=None,
    tokenizer=None,
    train_dataset=None,
    eval_dataset=None,
    reward_fns=None,
    reward_weights=None,
    environment=None,
) -> RunParts:
    """The parts of a run; each keyword, when given, replaces what the config would build
    (``sample_mesh``: the devices the sampler runs on, regrouped for decoding; default
    ``mesh``'s)."""
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(config, run_dir, model=model, tokenizer=tokenizer)
    pad_id, stop_ids = special_token_ids(tokenizer, model)
    episodes = episode_runner(config, tokenizer, stop_ids, environment)
    try:
        train, evals = prompt_sets(config, tokenizer, train_dataset, eval_dataset, episodes)
        extra_evals = extra_eval_sets(config, tokenizer, episodes)
        kinds = config.reward.kind if reward_fns is None else reward_fns
        for held_out in (evals, *extra_evals.values()):
            check_gym_entries(kinds, train, held_out)
    except BaseException:
        if episodes is not None:
            episodes.close()
        raise
    cache_dtype = config.rollout.cache_dtype
    sampler = Sampler(
        model,
        pad_token_id=pad_id,
        cache_dtype=None if cache_dtype == "auto" else jnp.dtype(cache_dtype),
        # Tensor-parallel over its devices: weights and KV pages split by heads.
        mesh=None
        if mesh is None
        else sh.sampling_mesh(sample_mesh or mesh, model.config.num_kv_heads),
        engine=config.rollout.engine,
        decode_slots=config.rollout.decode_slots,
        page_size=config.rollout.page_size,
        num_pages=config.rollout.num_pages or None,
        speculate=config.rollout.speculate,
        draft_tokens=config.rollout.draft_tokens,
        draft_depth=config.rollout.draft_depth,
    )
    train_scorer, scorer = make_scorers(config, reward_fns, reward_weights)
    return RunParts(
        config=config,
        run_dir=run_dir,
        model=model,
        tokenizer=tokenizer,
        sampler=sampler,
        scorer=train_scorer,
        eval_scorer=scorer,
        prompts=train,
        eval_prompt_ids=evals.ids if evals else [],
        eval_records=evals.records if evals else [],
        prompt_len=config.data.max_prompt_length,
        stop_token_ids=stop_ids,
        episodes=episodes,
        extra_evals=extra_evals,
    )
