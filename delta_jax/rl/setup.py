"""Assemble the parts of a run from its config: model, tokenizer, data, sampler, rewards."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.config import Config, ConfigError
from delta_jax.data import PromptPipeline, PromptRecord, encode_prompts, load_records
from delta_jax.losses import delta_coefficients
from delta_jax.rl.objectives import Objective, resolve_objective
from delta_jax.rl.train_step import make_old_pass

log = logging.getLogger(__name__)

DEMO_MODEL = "demo:tiny"
DEMO_DATA = "demo:arithmetic"


@dataclasses.dataclass
class RunParts:
    """Everything the loop needs besides the train state."""

    config: Config
    run_dir: Path
    model: Any
    tokenizer: Any
    sampler: Any
    scorer: Any  # training rewards (noisy when reward.flip_fraction > 0)
    eval_scorer: Any  # the verifier itself
    pipeline: PromptPipeline
    prompt_ids: list[list[int]]
    records: list[PromptRecord]
    eval_prompt_ids: list[list[int]]
    eval_records: list[PromptRecord]
    prompt_len: int
    stop_token_ids: tuple[int, ...]
    objective: Objective
    old_pass: Callable
    delta_from_hidden: Callable

    def prompt_batches(self) -> Iterator[list[tuple[list[int], PromptRecord]]]:
        """Batches of ``(prompt ids, record)`` drawn from the (checkpointable) pipeline."""
        while True:
            yield [(self.prompt_ids[i], self.records[i]) for i in next(self.pipeline)]

    def ref_logprobs(self, ref_params, rollout, micro_rows: int) -> jax.Array:
        """Reference-policy log-probs of the rollout's responses (for the KL penalty)."""
        out = []
        for s in range(0, rollout.input_ids.shape[0], micro_rows):
            logp, _, _ = self.old_pass(
                ref_params,
                jnp.asarray(rollout.input_ids[s : s + micro_rows]),
                jnp.asarray(rollout.attention_mask[s : s + micro_rows]),
            )
            out.append(logp)
        return jnp.concatenate(out)

    def evaluate(self, params, step: int) -> dict[str, float]:
        """Mean reward on the held-out prompts (the sampling settings of the run)."""
        from delta_jax.eval import evaluate_prompts

        cfg = self.config
        return evaluate_prompts(
            sampler=self.sampler,
            params=params,
            scorer=self.eval_scorer,
            tokenizer=self.tokenizer,
            prompt_ids=self.eval_prompt_ids,
            records=self.eval_records,
            k=1,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            stop_token_ids=self.stop_token_ids,
            seed=cfg.run.seed * 31 + step,
            prefix="eval/",
        )

    def close(self) -> None:
        self.eval_scorer.close()


def _load_model(config: Config, run_dir: Path):
    from delta_jax.demo import warm_up_demo_model
    from delta_jax.models import from_pretrained, load_tokenizer

    m = config.model
    path: str | Path = m.path
    if m.path == DEMO_MODEL:
        from delta_jax import distributed

        path = run_dir / "demo_model"
        if distributed.is_main_process():  # one writer; the others load what it saved
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
    dtype = jnp.dtype(m.dtype)
    model = from_pretrained(
        str(path),
        dtype=dtype,
        param_dtype=jnp.dtype(m.param_dtype),
        scan_layers=m.scan_layers,
        remat=m.remat,
    )
    return model, load_tokenizer(str(path))


def _load_records(config: Config, source: str, split: str, *, eval_set: bool):
    from delta_jax.demo import arithmetic_records

    d = config.data
    if source == DEMO_DATA:
        # Disjoint seeds: the held-out problems are drawn independently of the training ones.
        return arithmetic_records(
            d.limit or (256 if eval_set else 4096), seed=config.run.seed + (1 if eval_set else 0)
        )
    result = load_records(
        source, adapter=d.adapter, split=split, on_bad_row=d.on_bad_row, limit=d.limit
    )
    if result.skipped:
        log.warning("%s: skipped %d bad rows %s", source, result.skipped, result.skip_reasons)
    return result.records


def make_scorers(config: Config):
    """(training scorer, evaluation scorer): the same verifier, noisy for training only."""
    from delta_jax.rewards import FlippedRewards, RewardScorer

    r = config.reward
    scorer = RewardScorer(r.kind, num_workers=r.num_workers, timeout_s=r.timeout_s)
    if r.flip_fraction > 0:
        return FlippedRewards(scorer, r.flip_fraction, config.run.seed), scorer
    return scorer, scorer


def build_run_parts(config: Config, mesh=None) -> RunParts:
    from delta_jax.sampling import Sampler

    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = _load_model(config, run_dir)
    d = config.data
    template = d.template
    if d.source == DEMO_DATA and template is None:
        template = "{prompt}"  # the demo prompt is already the whole text

    def encode(records):
        enc = encode_prompts(
            records,
            tokenizer,
            max_prompt_length=d.max_prompt_length,
            truncation=d.truncation,
            system_prompt=d.system_prompt,
            template=template,
        )
        if enc.dropped:
            log.warning(
                "dropped %d prompts longer than %d tokens", enc.dropped, d.max_prompt_length
            )
        return enc

    train = encode(_load_records(config, d.source, d.split, eval_set=False))
    if len(train.ids) < config.rollout.prompts_per_step:
        raise ConfigError(
            f"data.source={d.source}: {len(train.ids)} usable prompts < "
            f"rollout.prompts_per_step={config.rollout.prompts_per_step}"
        )
    eval_source = d.eval_source or (DEMO_DATA if d.source == DEMO_DATA else None)
    evals = (
        encode(
            _load_records(config, eval_source, d.eval_split, eval_set=True)[
                : config.run.eval_prompts
            ]
        )
        if eval_source
        else None
    )
    if config.run.eval_every and evals is None:
        raise ConfigError("run.eval_every > 0 needs data.eval_source")
    pipeline = PromptPipeline(
        len(train.ids),
        batch_size=config.rollout.prompts_per_step,
        seed=config.run.seed,
        shuffle=d.shuffle,
        # Host-replicated rollouts: every process draws the same prompts (the sampler's
        # program spans all hosts); each feeds its own rows to the train step.
        process_index=0,
        process_count=1,
    )
    stop = {tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None)}
    stop_ids = tuple(sorted(int(s) for s in stop if isinstance(s, int | np.integer)))
    cache_dtype = config.rollout.cache_dtype
    sampler = Sampler(
        model,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        cache_dtype=None if cache_dtype == "auto" else jnp.dtype(cache_dtype),
        mesh=mesh,
    )
    objective = resolve_objective(config.algo, max_response_length=config.rollout.max_new_tokens)
    train_scorer, scorer = make_scorers(config)
    old_pass = make_old_pass(
        _graphdef(model),
        temperature=config.rollout.temperature or 1.0,
        gen_len=config.rollout.max_new_tokens,
        return_entropy=objective.uses_forking_mask,
    )
    delta_from_hidden = jax.jit(
        lambda h, lp, a, m: delta_coefficients(
            h, lp, a, m, return_diagnostics=True, **objective.delta_kwargs
        )
    )
    return RunParts(
        config=config,
        run_dir=run_dir,
        model=model,
        tokenizer=tokenizer,
        sampler=sampler,
        scorer=train_scorer,
        eval_scorer=scorer,
        pipeline=pipeline,
        prompt_ids=train.ids,
        records=train.records,
        eval_prompt_ids=evals.ids if evals else [],
        eval_records=evals.records if evals else [],
        prompt_len=d.max_prompt_length,
        stop_token_ids=stop_ids,
        objective=objective,
        old_pass=old_pass,
        delta_from_hidden=delta_from_hidden,
    )


def _graphdef(model):
    from flax import nnx

    return nnx.split(model, nnx.Param)[0]
