"""One rollout batch with its DelTA coefficients, for the heatmap and coefficient statistics.

A :class:`CoefficientBatch` holds, for ``B`` responses of at most ``T`` tokens, the token ids,
their self-normalised coefficients ``λ̄`` (DELTA_SPEC §3), the response mask, the sequence
advantages and rewards, and the text of every token. It is written as one ``.npz`` file (no
pickle) so that a training run can drop one per logged step under ``<run_dir>/diagnostics/``
and the plots can read them back later.

:func:`capture_batch` makes one from a model and prompts exactly as a DelTA step would: sample
``n`` responses per prompt (the sampler also returns the final hidden states and the
temperature-scaled log-probs, so no extra forward pass), score them, GRPO advantages, then
:func:`delta_jax.losses.delta_coefficients`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Bool, Float, Int

from delta_jax.deprecation import fold_keywords
from delta_jax.losses import DeltaOptions, delta_coefficients, grpo_advantages
from delta_jax.rewards import RewardScorer
from delta_jax.sampling import Sampler

if TYPE_CHECKING:
    from delta_jax.losses import DeltaOptions


def token_pieces(tokenizer: Any, ids: Sequence[int], *, context: int = 4) -> list[str]:
    """The text each token adds to the decoded string; the pieces join to the full decoding.

    A byte-level BPE token can hold part of a multi-byte character, which decodes alone to
    ``"\ufffd"``. Tokens that leave a character incomplete get an empty piece and the token that
    completes it gets the whole character (a run is cut after 4 tokens, the longest UTF-8
    character, so invalid bytes cannot hold pieces back forever). Each piece is a difference of
    two decodings with ``context`` tokens of left context, so that tokenizers that drop or add
    a space at the start of a decoding are handled.

    Args:
      tokenizer: a ``transformers`` tokenizer.
      ids: ``[T]`` token ids.
      context: tokens of left context per piece.

    Returns:
      ``T`` strings.
    """
    ids = [int(i) for i in ids]
    decode = lambda xs: tokenizer.decode(xs, skip_special_tokens=False)
    pieces: list[str] = []
    start = 0  # first token whose text is not yet emitted
    for i in range(len(ids)):
        lo = max(0, start - context)
        before, full = decode(ids[lo:start]), decode(ids[lo : i + 1])
        if full.endswith("\ufffd") and i + 1 < len(ids) and i - start < 3:
            pieces.append("")
            continue
        same_prefix = full.startswith(before)
        pieces.append(full[len(before) :] if same_prefix else decode(ids[start : i + 1]))
        start = i + 1
    return pieces


@dataclasses.dataclass(frozen=True)
class CoefficientBatch:
    """A rollout batch with its DelTA coefficients (rows are prompt-major groups of ``n``).

    Attributes:
      token_ids: int32 ``[B, T]`` response ids (anything on padding).
      coefficients: float32 ``[B, T]`` ``λ̄`` (0 on padding).
      mask: bool ``[B, T]`` real response tokens.
      advantages: float32 ``[B]`` sequence advantages ``Â`` (sign = side).
      rewards: float32 ``[B]``.
      prompts: ``B`` prompt texts.
      pieces: ``B`` lists with the text of each real token.
      group_size: responses per prompt (``n``).
      step: training step the batch comes from (0: before RL).
    """

    token_ids: Int[np.ndarray, "B T"]
    coefficients: Float[np.ndarray, "B T"]
    mask: Bool[np.ndarray, "B T"]
    advantages: Float[np.ndarray, " B"]
    rewards: Float[np.ndarray, " B"]
    prompts: list[str]
    pieces: list[list[str]]
    group_size: int = 1
    step: int = 0

    def __post_init__(self):
        b, t = np.shape(self.token_ids)
        for name in ("coefficients", "mask"):
            if np.shape(getattr(self, name)) != (b, t):
                raise ValueError(
                    f"{name} has shape {np.shape(getattr(self, name))}, token_ids has {(b, t)}"
                )
        for name in ("advantages", "rewards", "prompts", "pieces"):
            if len(getattr(self, name)) != b:
                raise ValueError(f"{name} has {len(getattr(self, name))} rows, expected {b}")
        lengths = np.asarray(self.mask).sum(axis=1)
        bad = [i for i in range(b) if len(self.pieces[i]) != lengths[i]]
        if bad:
            raise ValueError(f"pieces of rows {bad[:5]} do not match their masked lengths")

    @classmethod
    def from_arrays(
        cls,
        tokenizer: Any,
        *,
        token_ids,
        coefficients,
        mask,
        advantages,
        rewards,
        prompts: Sequence[str],
        group_size: int = 1,
        step: int = 0,
    ) -> CoefficientBatch:
        """Builds a batch from (device or host) arrays, decoding each token's text.

        This is what a training loop calls, e.g. with a :class:`~delta_jax.rl.rollout.Rollout`
        and the coefficients of its step::

          CoefficientBatch.from_arrays(tok, token_ids=ro.sequences[:, P:], coefficients=coef,
                                       mask=np.arange(G) < ro.lengths[:, None],
                                       advantages=ro.advantages,
                                       rewards=ro.rewards, prompts=[r.prompt for r in ro.records],
                                       group_size=n, step=step).save(path)
        """
        ids = np.asarray(token_ids, np.int32)
        m = np.asarray(mask, bool)
        return cls(
            token_ids=ids,
            coefficients=np.asarray(coefficients, np.float32),
            mask=m,
            advantages=np.asarray(advantages, np.float32),
            rewards=np.asarray(rewards, np.float32),
            prompts=list(prompts),
            pieces=[token_pieces(tokenizer, ids[i][m[i]].tolist()) for i in range(len(ids))],
            group_size=group_size,
            step=step,
        )

    def save(self, path: str | Path) -> Path:
        """Writes the batch as a compressed ``.npz`` (strings as JSON, no pickle)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"prompts": self.prompts, "pieces": self.pieces})
        np.savez_compressed(
            path,
            token_ids=self.token_ids,
            coefficients=self.coefficients,
            mask=self.mask,
            advantages=self.advantages,
            rewards=self.rewards,
            meta=np.array([self.group_size, self.step], np.int64),
            text=np.array(text),
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> CoefficientBatch:
        """Reads a batch written by :meth:`save`."""
        with np.load(path, allow_pickle=False) as f:
            text = json.loads(str(f["text"]))
            return cls(
                token_ids=f["token_ids"],
                coefficients=f["coefficients"],
                mask=f["mask"],
                advantages=f["advantages"],
                rewards=f["rewards"],
                prompts=text["prompts"],
                pieces=text["pieces"],
                group_size=int(f["meta"][0]),
                step=int(f["meta"][1]),
            )


@dataclasses.dataclass(frozen=True)
class CaptureSampling:
    """How :func:`capture_batch` samples its responses.

    Attributes:
      n: responses per prompt (the GRPO group).
      max_new_tokens: response budget.
      temperature: sampling temperature (the log-probs are taken at it, as in training).
      top_p: nucleus mass.
      seed: sampling seed.
    """

    n: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


def capture_batch(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    records: Sequence,
    *,
    sampling: CaptureSampling = CaptureSampling(),
    reward: Any = "math",
    step: int = 0,
    params: Any = None,
    delta_options: DeltaOptions | None = None,
    **legacy: Any,
) -> CoefficientBatch:
    """Samples, scores and computes the DelTA coefficients of one batch, as a DelTA step would.

    Args:
      model: a :class:`~delta_jax.models.Transformer`.
      tokenizer: its tokenizer.
      prompt_ids: ``P`` prompts as token ids.
      records: ``P`` :class:`~delta_jax.data.PromptRecord` (the rewards' answers/tests).
      sampling: :class:`CaptureSampling`: responses per prompt, budget, temperature, top-p,
        seed.
      reward: a :class:`~delta_jax.rewards.RewardScorer` kind (scored in-process).
      step: recorded in the batch.
      params: parameters to sample with (None: the model's own).
      delta_options: the :class:`~delta_jax.losses.DeltaOptions` (None: the defaults).
      **legacy: the fields of :class:`CaptureSampling` as keywords (``n=8``), the call form of
        earlier releases: deprecated, they replace those of ``sampling``.

    Returns:
      A :class:`CoefficientBatch` of ``P · n`` rows.
    """
    sampling = fold_keywords("capture_batch", sampling, legacy, "sampling=CaptureSampling(...)")
    n = sampling.n
    if len(prompt_ids) != len(records) or not records:
        raise ValueError(
            f"need as many prompt_ids as records (> 0), got {len(prompt_ids)} and {len(records)}"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = {tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None)}
    stops = tuple(sorted(int(s) for s in eos if isinstance(s, int | np.integer)))
    out = Sampler(model, pad_token_id=pad).generate(
        [list(p) for p in prompt_ids],
        n=n,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop_token_ids=stops,
        return_hidden=True,
        params=params,
    )
    rows = out.num_rows
    lengths = np.asarray(out.lengths)
    width = max(int(lengths.max()), 1)
    mask = np.arange(width)[None, :] < lengths[:, None]
    texts = tokenizer.batch_decode(out.tokens, skip_special_tokens=True)
    row_records = [r for r in records for _ in range(n)]
    items = [{"answer": r.answer, "tests": r.tests, **r.extra} for r in row_records]
    with RewardScorer(reward, num_workers=0) as scorer:
        rewards = np.asarray(scorer.score([r.prompt for r in row_records], texts, items).rewards)
    advantages = np.asarray(grpo_advantages(jnp.asarray(rewards), n))
    coefficients = delta_coefficients(
        out.hidden_array[:rows, :width],
        out.untruncated_logprob_array[:rows, :width],
        jnp.asarray(advantages),
        jnp.asarray(mask),
        delta_options or DeltaOptions(),
    )
    return CoefficientBatch.from_arrays(
        tokenizer,
        token_ids=np.asarray(out.token_array)[:rows, :width],
        coefficients=coefficients,
        mask=mask,
        advantages=advantages,
        rewards=rewards,
        prompts=[r.prompt for r in row_records],
        group_size=n,
        step=step,
    )
