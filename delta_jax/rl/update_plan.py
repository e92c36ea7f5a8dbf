"""The update plan: what one RL step computes between the rollout and the optimiser, decided once.

A frozen :class:`UpdatePlan` is built from the config before the run starts and read by the loop
(which stages run), the train step (which inputs the loss takes) and the memory planner (which
program to compile). Nothing downstream infers a mode from missing inputs.

Every objective learns from the actions: the response tokens the policy drew. In a single-turn
rollout that is every response token; in a multi-turn one, not the observations an environment
wrote between the policy's turns (``Rollout.action_mask``), which are context only. Advantages,
log-probs, the loss and its normaliser, KL, entropy and DelTA's statistics run over the actions
alone (``TrainBatch.loss_mask``).

Where the DelTA coefficients come from (:attr:`UpdatePlan.coefficients`), DELTA_SPEC §4:

* ``"in_loss"``: one update on the whole rollout batch in one micro-batch (padded rows, or
  packed ones ``bucketed`` or in micro-batches that hold every row): the jitted loss computes
  them from the stop-gradient hidden states of its own forward pass (no extra pass);
* ``"sampler"``: one update that can run several micro-batches (``algo.micro_batches``, or
  packed micro-batches of ``algo.micro_batch_rows``): from the hidden states the sampler kept
  while generating (again no extra pass), held fixed across the micro-batches;
* ``"old_pass"``: several updates per rollout batch, or several micro-batches under partial or
  asynchronous rollouts (``rollout.over_provision``, ``rollout.async_devices``: rows drawn by
  older policies, carried rows without the sampler's hidden states):
  one old-policy pass (which also gives the old log-probs) before the first update; held fixed
  for every update;
* ``"none"``: the objective does not use them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from delta_jax.config import Config, load_config
from delta_jax.models.attention import resolve_impl
from delta_jax.rl.objectives import Objective, resolve_objective

CoefficientSource = Literal["none", "in_loss", "sampler", "old_pass"]


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """Static description of one RL step's update (see module docstring).

    Attributes:
      objective: the loss preset with the config's overrides.
      prompt_len: P, longest prompt; gen_len: G, longest response.
      temperature: the sampling temperature the log-probs are recomputed at.
      rows: responses per rollout batch.
      mini_batches: optimiser updates per rollout batch; micro_batches: gradient-accumulation
        steps per update.
      coefficients: where DelTA's coefficients come from.
      old_pass: the old log-probs come from a pass before the updates (else: the update's own
        forward, stop-gradient; on-policy).
      reference: a reference-policy pass gives log-probs for the KL penalty.
      packing: sequences are packed into rows of ``tokens_per_row`` (else one padded per row).
      share_prompts: packed rows may hold a prompt once for several of its responses (the
        train step takes rotary positions and parent segments; :mod:`delta_jax.rl.packing`).
      share_if_fewer_rows: ``algo.share_prompts=auto``: a step shares only when that packs it
        into fewer rows (:func:`shares_prompts` decides whether it may).
      group_size: responses per prompt (consecutive rollout sequences share their prompt).
      tokens_per_row: T of a packed row.
      micro_batch_rows: packed rows per micro-batch (``algo.micro_batch_rows``, rounded up to
        the batch shards), a step running as many micro-batches as its rows need: one update
        shape whatever the lengths. 0: a step's rows in one micro-batch, in buckets
        (:func:`~delta_jax.rl.packing.micro_batch_shape`).
      delta_scope: ``"global"`` or ``"per_shard"`` DelTA statistics.
      skip_empty_slots: the LM head skips chunks of scored slots that no row uses (a CPU path:
        on the TPU compiler the skip's ``lax.cond`` costs the train step of
        ``configs/qwen3_8b_delta.yaml`` 97 GiB of temporaries against 72 GiB without).
    """

    objective: Objective
    prompt_len: int
    gen_len: int
    temperature: float
    rows: int
    mini_batches: int
    micro_batches: int
    coefficients: CoefficientSource
    old_pass: bool
    reference: bool
    packing: bool
    share_prompts: bool
    share_if_fewer_rows: bool
    group_size: int
    tokens_per_row: int
    delta_scope: str
    micro_batch_rows: int = 0
    skip_empty_slots: bool = False

    @classmethod
    def padded(cls, loss: str, prompt_len: int, gen_len: int, rows: int, *overrides: str):
        """The plan of one update on ``rows`` sequences (pairs of samples), one padded sequence
        per row, default config otherwise (``overrides``: more ``key=value``): for benchmarks
        and tests that build their batches by hand."""
        return cls.from_config(
            load_config(
                None,
                [
                    f"algo.loss={loss}",
                    "algo.packing=false",
                    f"data.max_prompt_length={prompt_len}",
                    f"rollout.max_new_tokens={gen_len}",
                    f"rollout.prompts_per_step={max(rows // 2, 1)}",
                    "rollout.samples_per_prompt=2",
                    *overrides,
                ],
            )
        )

    @classmethod
    def from_config(cls, config: Config, platform: str | None = None) -> UpdatePlan:
        """The plan of ``config`` on ``platform`` (default: JAX's default backend)."""
        r, a = config.rollout, config.algo
        objective = resolve_objective(a, max_response_length=r.max_new_tokens)
        P, G = config.data.max_prompt_length, r.max_new_tokens
        T = a.tokens_per_row or longest_sequence(P, G)
        platform = platform or jax.default_backend()
        share = shares_prompts(config, T, platform)
        rows = r.prompts_per_step * r.samples_per_prompt
        mini, micro = a.mini_batches, a.micro_batches
        micro_rows = micro_batch_rows(config, T, platform)
        # Several micro-batches: the coefficients come from outside the loss (DELTA_SPEC §4).
        several = micro > 1 or 0 < micro_rows < rows // mini
        coefficients: CoefficientSource = "none"
        if objective.uses_delta:
            # Partial and asynchronous rollouts draw rows under older policies (carried rows
            # without hidden states): an old-policy pass gives them, at the update's start.
            off_policy = r.over_provision > 0 or r.async_devices > 0
            before = mini > 1 or (several and off_policy)
            coefficients = "old_pass" if before else "sampler" if several else "in_loss"
        return cls(
            objective=objective,
            prompt_len=P,
            gen_len=G,
            temperature=r.temperature or 1.0,
            rows=rows,
            mini_batches=mini,
            micro_batches=micro,
            coefficients=coefficients,
            old_pass=mini > 1 or coefficients == "old_pass",
            reference=a.kl_coef > 0,
            packing=a.packing,
            share_prompts=share,
            share_if_fewer_rows=share and a.share_prompts == "auto",
            group_size=r.samples_per_prompt,
            tokens_per_row=T,
            delta_scope=a.delta_scope,
            micro_batch_rows=micro_rows,
            skip_empty_slots=platform == "cpu",
        )

    @property
    def prepares(self) -> bool:
        """Whether anything runs between the rollout and the first update."""
        return self.old_pass or self.reference or self.coefficients == "sampler"

    @property
    def fixed_token_mask(self) -> bool:
        """Forking-token mask from the old pass's entropy (else from the update's own)."""
        return self.objective.uses_forking_mask and self.old_pass

    @property
    def row_len(self) -> int:
        """Input positions of a row: a packed row, or one padded sequence ``P + G - 1``."""
        return (
            self.tokens_per_row if self.packing else longest_sequence(self.prompt_len, self.gen_len)
        )

    @property
    def score_from(self) -> int:
        """Padded rows: the first position whose prediction can be a response token (the LM head
        skips the rest). Packed rows list their response positions instead (0 here)."""
        return 0 if self.packing else self.prompt_len - 1

    @property
    def window(self) -> int:
        """W: positions per row that carry per-token loss inputs (packed rows: slots, as many as
        a row's positions, the LM head skipping the chunks no row uses)."""
        return self.row_len - self.score_from

    @property
    def rows_per_update(self) -> int:
        return self.rows // self.mini_batches


# Tokens per batch shard of a micro-batch that ``algo.micro_batch_rows: auto`` aims at: each
# micro-batch writes and accumulates a gradient of every weight (and on a TPU or GPU reads
# every weight again from HBM), so a few thousand tokens keep that a small part of its matmuls
# there; on XLA:CPU, where a step's rows are few, about 512 balance that cost against the
# padding of a step's last micro-batch (benchmarks/micro_batch_rows.py --update).
MICRO_BATCH_TOKENS = {"cpu": 512}
MICRO_BATCH_TOKENS_ACCELERATOR = 2048


def micro_batch_rows(config: Config, row_len: int, platform: str) -> int:
    """Packed rows per micro-batch (``algo.micro_batch_rows``; 0: bucketed, or padded rows)."""
    a, r = config.algo, config.rollout
    if not a.packing or a.micro_batch_rows == "bucketed":
        return 0
    budget = r.prompts_per_step * r.samples_per_prompt // a.mini_batches // a.micro_batches
    if a.micro_batch_rows != "auto":
        return a.micro_batch_rows
    tokens = MICRO_BATCH_TOKENS.get(platform, MICRO_BATCH_TOKENS_ACCELERATOR)
    return min(budget, -(-tokens // row_len))


def shares_prompts(config: Config, row_len: int, platform: str) -> bool:
    """Whether the update's packed rows hold each prompt once for its responses.

    ``algo.share_prompts: auto`` may share in packed rows, and then each step shares where
    that takes fewer rows (:func:`delta_jax.rl.packing.plan_rows`). Sharing never adds a
    position (a chunk is its sequences less the repeated prompts) and on the XLA attention paths
    (dense, chunked, cuDNN) costs one more comparison in the mask; but a row of shared prompts
    holds more responses, so its scored window can be wider: a step that saves no row is not
    shared. The splash kernel
    (TPU) takes no second mask, so a program with shared rows runs it twice per layer
    (:func:`delta_jax.models.attention.splash`): there auto may share only when a row can hold
    the longest prompt with two of the longest responses.
    """
    a, P, G = config.algo, config.data.max_prompt_length, config.rollout.max_new_tokens
    if a.share_prompts != "auto":
        return a.share_prompts
    if not a.packing:  # (groups: every advantage needs two samples or more per prompt)
        return False
    impl = resolve_impl(config.model.attention, row_len, platform)
    return impl != "splash" or row_len >= P + 2 * (G - 1)


def longest_sequence(prompt_len: int, gen_len: int) -> int:
    """Input positions of the longest prompt + response (the last token predicts nothing)."""
    return prompt_len + gen_len - 1
