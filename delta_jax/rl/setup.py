"""Assemble the parts of a run from its config: model, tokenizer, data, sampler, rewards."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from delta_jax import sharding as sh
from delta_jax.config import Config, ConfigError
from delta_jax.data import PromptPipeline, PromptRecord, encode_prompts, load_records

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from delta_jax.models import Transformer
    from delta_jax.rewards import FlippedRewards, RewardScorer
    from delta_jax.sampling import Sampler

log = logging.getLogger(__name__)

DEMO_MODEL = "demo:tiny"
DEMO_DATA = "demo:arithmetic"


@dataclasses.dataclass
class RunParts:
    """Everything the loop needs besides the train state and the update plan."""

    config: Config
    run_dir: Path
    model: Transformer
    tokenizer: PreTrainedTokenizerBase
    sampler: Sampler
    scorer: RewardScorer | FlippedRewards  # training rewards (noisy if reward.flip_fraction > 0)
    eval_scorer: RewardScorer  # the verifier itself
    pipeline: PromptPipeline
    prompt_ids: list[list[int]]
    records: list[PromptRecord]
    eval_prompt_ids: list[list[int]]
    eval_records: list[PromptRecord]
    prompt_len: int
    stop_token_ids: tuple[int, ...]

    def prompt_batches(self) -> Iterator[list[tuple[list[int], PromptRecord]]]:
        """Batches of ``(prompt ids, record)`` drawn from the (checkpointable) pipeline."""
        while True:
            yield [(self.prompt_ids[i], self.records[i]) for i in next(self.pipeline)]

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


def special_token_ids(tokenizer, model) -> tuple[int, tuple[int, ...]]:
    """``(pad id, stop ids)`` of a policy: the tokenizer's and the model config's EOS ids."""
    stop = {tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None)}
    stop_ids = tuple(sorted(int(s) for s in stop if isinstance(s, int | np.integer)))
    pad = tokenizer.pad_token_id
    return (pad if pad is not None else 0), stop_ids


def load_model(config: Config, run_dir: Path):
    """The run's policy and tokenizer (the demo model is warmed up once, by process 0)."""
    from delta_jax.demo import warm_up_demo_model
    from delta_jax.models import from_pretrained, load_tokenizer, resolve_model_dir

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
    path = resolve_model_dir(str(path), revision=m.revision)  # a hub id: downloaded once
    dtype = jnp.dtype(m.dtype)
    model = from_pretrained(
        str(path),
        dtype=dtype,
        param_dtype=jnp.dtype(m.param_dtype),
        scan_layers=m.scan_layers,
        remat=m.remat,
        attention=m.attention,
        attention_block=m.attention_block,
    )
    if m.lora_rank:
        from delta_jax.models import lora

        lora.add_adapters(
            model,
            rank=m.lora_rank,
            alpha=m.lora_alpha,
            targets=m.lora_targets,
            seed=config.run.seed,
        )
    return model, load_tokenizer(str(path))


def _load_records(config: Config, source: str, split: str, *, eval_set: bool):
    from delta_jax.demo import arithmetic_records

    d = config.data
    if source == DEMO_DATA:
        # Disjoint seeds: the held-out problems are drawn independently of the training ones;
        # as many as the evaluation uses (``run.eval_prompts``).
        count = config.run.eval_prompts if eval_set else 4096
        return arithmetic_records(d.limit or count, seed=config.run.seed + (1 if eval_set else 0))
    result = load_records(
        source,
        adapter=d.adapter,
        split=split,
        config=d.subset,
        on_bad_row=d.on_bad_row,
        limit=d.limit,
    )
    if result.skipped:
        log.warning("%s: skipped %d bad rows %s", source, result.skipped, result.skip_reasons)
    return result.records


def _encoded_prompts(config: Config, tokenizer):
    """The encoded training prompts and held-out ones (None without an eval source)."""
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
    evals = None
    if eval_source:
        held_out = _load_records(config, eval_source, d.eval_split, eval_set=True)
        evals = encode(held_out[: config.run.eval_prompts])
    if config.run.eval_every and evals is None:
        raise ConfigError("run.eval_every > 0 needs data.eval_source")
    return train, evals


def make_scorers(config: Config) -> tuple[RewardScorer | FlippedRewards, RewardScorer]:
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
    model, tokenizer = load_model(config, run_dir)
    train, evals = _encoded_prompts(config, tokenizer)
    pipeline = PromptPipeline(
        len(train.ids),
        batch_size=config.rollout.prompts_per_step,
        seed=config.run.seed,
        shuffle=config.data.shuffle,
        # Host-replicated rollouts: every process draws the same prompts (the sampler's
        # program spans all hosts); each feeds its own rows to the train step.
        process_index=0,
        process_count=1,
    )
    pad_id, stop_ids = special_token_ids(tokenizer, model)
    cache_dtype = config.rollout.cache_dtype
    sampler = Sampler(
        model,
        pad_token_id=pad_id,
        cache_dtype=None if cache_dtype == "auto" else jnp.dtype(cache_dtype),
        # Tensor-parallel over the same devices: weights and KV pages split by heads.
        mesh=None if mesh is None else sh.sampling_mesh(mesh, model.config.num_kv_heads),
        engine=config.rollout.engine,
        decode_slots=config.rollout.decode_slots,
        page_size=config.rollout.page_size,
        num_pages=config.rollout.num_pages or None,
    )
    train_scorer, scorer = make_scorers(config)
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
        prompt_len=config.data.max_prompt_length,
        stop_token_ids=stop_ids,
    )
