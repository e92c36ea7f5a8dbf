"""Step-time roofline of a plan: how long an RL step takes at best on the slice, from the TPU
compiler's cost analysis and the chip's peak FLOP/s and HBM bandwidth.

A program's time bound is ``max(flops / peak, bytes / bandwidth)`` per device. The figures per
RL step:

* rollout: the engine's decode steps (``ceil(sequences / slots)`` rounds of ``mean_new`` tokens
  per data group: slots kept full) times the decode chunk's per-step bound, plus its prefill
  (every prompt token at the prefill chunk's per-token cost);
* update: ``algo.mini_batches`` train steps;
* the run: ``run.steps`` of them, in hours and chip-hours.

XLA's cost analysis counts a loop body once, whatever its trip count, and a Pallas kernel's
inside not at all. The programs' figures (``ProgramMemory.flops``/``bytes_accessed``) count
every loop body times its trip count where that is a constant (:mod:`.hlo`: the micro-batch
loop, the chunked LM head, the partitioner's windowed matmul loops); a loop bounded at run time
counts once, so the decode chunk's figures are one step (its step loop ends at a step argument
or when its sequences end; its layers are unrolled). The train step is compiled twice more with
1 and 2 unrolled layers and extrapolated to ``L`` (``layers_extrapolated``); the ragged paged
attention kernel's K/V reads (``kv_bytes_per_token``) are added to the decode's bytes, and the
splash kernels the train step calls (read from its HLO, each call as often as its loop runs, a
rematerialised forward twice) are added to its FLOPs and bytes (``splash_cost``: the causal
mask's blocks, each the kernel's own matmuls).

The model-FLOPs utilisation bound is the model's FLOPs (``6 N`` per token for the weight
matmuls, ``N`` the matmul parameters, LM head included, plus causal attention's ``6 L Nq D T^2``
per row of ``T`` tokens) over the compiled FLOPs: what remat and padding cost. The decode's HBM
bytes per useful token are set against the minimum: the sampling weights read once per step for
the group's active slots, plus the K/V each token reads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# Per chip, dense bfloat16 peak FLOP/s and HBM bandwidth (bytes/s), from Google Cloud's TPU
# system-architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e), as of 2025.
CHIPS: dict[str, tuple[float, float]] = {
    "v4": (275e12, 1200e9),
    "v5e": (197e12, 819e9),
    "v5p": (459e12, 2765e9),
    "v6e": (918e12, 1640e9),
}
CHIPS_SOURCE = "Google Cloud TPU docs (system architecture: v4, v5e, v5p, v6e), bf16 dense peak"


def chip(topology_name: str) -> tuple[str, float, float]:
    """``(generation, peak FLOP/s, HBM bytes/s)`` of one chip of ``topology_name``."""
    gen = topology_name.strip().lower().split("-")[0].replace("v5litepod", "v5e")
    if gen not in CHIPS:
        raise ValueError(f"no chip constants for {gen!r}; known: {sorted(CHIPS)}")
    return (gen, *CHIPS[gen])


def matmul_params(mc) -> int:
    """Weights a token multiplies through: attention and MLP projections, and the LM head."""
    H, F, N, K, D = (
        mc.hidden_size,
        mc.intermediate_size,
        mc.num_heads,
        mc.num_kv_heads,
        mc.head_dim,
    )
    return mc.num_layers * (2 * H * N * D + 2 * H * K * D + 3 * H * F) + mc.vocab_size * H


def train_model_flops(mc, rows: int, tokens: int) -> float:
    """Model FLOPs of forward + backward over ``rows`` causal rows of ``tokens`` tokens."""
    attention = 6 * mc.num_layers * mc.num_heads * mc.head_dim * tokens**2
    return rows * (6 * matmul_params(mc) * tokens + attention)


def kv_bytes_per_token(mc, context: float, kv_heads: int, cache_itemsize: int) -> float:
    """K/V bytes one decoded token reads on a device holding ``kv_heads`` KV heads."""
    return mc.num_layers * 2 * kv_heads * mc.head_dim * cache_itemsize * context


def layers_extrapolated(one: float, two: float, layers: int) -> float:
    """A figure of an ``L``-layer program from its 1- and 2-layer compiles (linear in layers)."""
    return one + (layers - 1) * (two - one)


def splash_cost(calls, block: int) -> tuple[float, float]:
    """``(FLOPs, HBM bytes)`` of a program's splash-attention kernel calls (``SplashCalls``).

    With ``b = min(block, T)`` the kernels visit the causal mask's ``n (n + 1) / 2`` blocks of
    ``n = T / b`` per row and query head; each block is ``2 b^2 D`` FLOPs per matmul: 2 in the
    forward (``QK^T``, ``PV``), 3 in the dq kernel (``QK^T``, ``dO V^T``, ``dS K``) and 4 in the
    dkv kernel (``QK^T``, ``dO V^T``, ``P^T dO``, ``dS^T Q``), as JAX's kernel computes them. Bytes:
    each visited block streams two ``[b, D]`` operands (K and V, or Q and dO), and each row of
    blocks reads and writes its own ``[b, D]`` arrays once (forward: Q, O; dq: Q, dO, dQ; dkv: K,
    V, dK, dV).
    """
    if calls is None:
        return 0.0, 0.0
    B, N, T, D = calls.shape
    b = min(block, T)
    n = T // b
    blocks = n * (n + 1) // 2
    dots = 2 * calls.fwd + 3 * calls.dq + 4 * calls.dkv
    flops = B * N * blocks * 2 * b * b * D * dots
    streamed = blocks * 2 * b * D * (calls.fwd + calls.dq + calls.dkv)
    own = n * b * D * (2 * calls.fwd + 3 * calls.dq + 4 * calls.dkv)
    return float(flops), float(B * N * (streamed + own) * calls.itemsize)


def bound(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    return max(flops / peak, nbytes / bandwidth)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Per-device time bounds of one RL step and the run, seconds unless named otherwise."""

    chip: str
    peak_flops: float
    hbm_bandwidth: float
    mean_new_tokens: float
    decode_step_flops: float  # one decode step of a data group, per device
    decode_step_bytes: float  # compiled + the kernel's K/V reads
    decode_steps: int  # per data group and RL step
    decode_s: float
    prefill_s: float
    train_flops: float  # one mini-batch (every micro-batch), per device
    train_bytes: float
    train_model_flops: float  # per device, of the rows the update runs
    compiled_rows: int  # rows per mini-batch of the compiled train step (its micro-batches)
    update_rows: int  # ... the update runs at the mean lengths (packed; the rest skipped)
    update_positions: float  # input positions of those rows, all devices
    shared_prompts: bool  # the rows hold each prompt once for its responses
    update_s: float  # every mini-batch
    update_mfu: float  # the model's FLOPs at peak over update_s
    update_limit: str  # what bounds the train step: "HBM" or "FLOP/s"
    train_loops_once: int  # loops of the train programs counted once (trip count not found)
    bytes_per_token: float  # decode, per device and useful token
    min_bytes_per_token: float
    steps: int
    chips: int
    # Speculative rollouts (draft_tokens > 0): the verify chunk's per-step figures, and its
    # steps at the given tokens per verify step (a measured acceptance).
    draft_tokens: int = 0
    draft_depth: int = 0  # a trie of the drafts up to this deep (0: a line)
    verify_attention: str = ""  # the paged attention path the verify chunk compiled with
    tokens_per_step: float = 1.0
    verify_step_flops: float = 0.0
    verify_step_bytes: float = 0.0
    verify_steps: int = 0
    verify_s: float = 0.0
    lengths: Any = None  # schedules.LengthBounds: the rollout at a length distribution

    @property
    def rollout_s(self) -> float:
        return self.decode_s + self.prefill_s

    @property
    def speculative_rollout_s(self) -> float:
        return self.verify_s + self.prefill_s

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.update_s

    @property
    def mfu_bound(self) -> float:
        run = self.train_flops * self.update_rows / self.compiled_rows
        return self.train_model_flops / run if self.train_flops else math.nan

    @property
    def run_hours(self) -> float:
        return self.steps * self.step_s / 3600

    def lines(self) -> list[str]:
        h = self.run_hours
        return [
            f"step-time roofline ({self.chip}: {self.peak_flops / 1e12:.0f} TFLOP/s bf16, "
            f"{self.hbm_bandwidth / 1e9:.0f} GB/s HBM per chip; {CHIPS_SOURCE}), "
            f"{self.mean_new_tokens:.0f} new tokens per sequence:",
            f"  rollout >= {self.rollout_s:,.1f} s (decode {self.decode_steps:,} steps x "
            f"{self.decode_s / max(self.decode_steps, 1) * 1e3:.2f} ms = {self.decode_s:,.1f} s; "
            f"prefill {self.prefill_s:,.1f} s)",
            *self._speculative_lines(),
            f"  decode HBM bytes per useful token {self.bytes_per_token / 2**20:,.2f} MiB per "
            f"device; minimum {self.min_bytes_per_token / 2**20:,.2f} MiB "
            f"({self.bytes_per_token / self.min_bytes_per_token:.2f}x)",
            f"  update runs {self.update_rows:,} of the compiled {self.compiled_rows:,} rows per "
            f"mini-batch at these lengths ({self.update_positions:,.0f} positions"
            + ("; each prompt once per row for its responses)" if self.shared_prompts else ")"),
            f"  update >= {self.update_s:,.1f} s ({self.train_flops / 1e12:,.1f} TFLOP per device "
            f"per mini-batch compiled, {self.train_model_flops / 1e12:,.1f} the model's in the "
            "rows run; "
            + (
                f"model-FLOPs utilisation bound {self.mfu_bound:.0%}; "
                f"{self.update_mfu:.0%} at the update's bound, {self.update_limit}-bound)"
                if self.mfu_bound <= 1
                else "compiled below the model's: the cost analysis misses work, no MFU bound)"
            ),
            *(
                [
                    f"  (the train step's cost counts {self.train_loops_once} loop(s) once: "
                    "trip count not found; its figures are a lower bound)"
                ]
                if self.train_loops_once
                else []
            ),
            f"  step >= {self.step_s:,.1f} s; {self.steps} steps >= {h:,.1f} h = "
            f"{h * self.chips:,.0f} chip-hours on {self.chips} chips",
            *(self.lengths.lines() if self.lengths is not None else []),
        ]

    def _speculative_lines(self) -> list[str]:
        if not self.draft_tokens:
            return []
        spec, per_step = self.speculative_rollout_s, self.verify_s / max(self.verify_steps, 1)
        cost = per_step / (self.decode_s / max(self.decode_steps, 1))
        trie = f" in a trie up to {self.draft_depth} deep" if self.draft_depth else ""
        return [
            f"  rollout with speculation >= {spec:,.1f} s, {self.rollout_s / spec:.2f}x lower "
            f"(k={self.draft_tokens}{trie}, {self.verify_attention} attention, "
            f"{self.tokens_per_step:.2f} tokens per verify step as "
            f"given: {self.verify_steps:,} verify steps x {per_step * 1e3:.2f} ms = "
            f"{self.verify_s:,.1f} s, a verify step {cost:.2f}x "
            f"a decode step; prefill {self.prefill_s:,.1f} s); step >= "
            f"{spec + self.update_s:,.1f} s"
        ]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the roofline assumes of the run's sequences.

    ``mean_new_tokens``: the expected new tokens per sequence (None: ``rollout.max_new_tokens``,
    the longest); ``tokens_per_step``: a measured tokens per speculative verify step (e.g. a
    run's ``speculate/tokens_per_step``): the roofline also bounds the rollout with speculation
    (None: it does not); ``lengths``: a response-length distribution (``lengths.Lengths``): the
    mean new tokens are its mean, and the roofline also bounds the rollout at its lengths
    (``schedules``), asynchronous rollouts with at most ``max_staleness`` versions in flight.
    """

    mean_new_tokens: float | None = None
    tokens_per_step: float | None = None
    lengths: Any = None
    max_staleness: int = 1

    def mean_new(self, rollout) -> float:
        """The mean new tokens per sequence, checked against the run's ``rollout`` config."""
        if self.max_staleness < 1:
            raise ValueError(f"--max-staleness={self.max_staleness} must be >= 1")
        if self.lengths is not None:
            if self.mean_new_tokens is not None:
                raise ValueError("--lengths sets the mean new tokens: drop --mean-new-tokens")
            return self.lengths.mean
        longest = rollout.max_new_tokens
        mean_new = longest if self.mean_new_tokens is None else self.mean_new_tokens
        if not 0 < mean_new <= longest:
            raise ValueError(
                f"--mean-new-tokens={mean_new} must be in (0, rollout.max_new_tokens={longest}]"
            )
        return mean_new


@dataclasses.dataclass(frozen=True)
class Slice:
    """The TPU slice: its topology name (e.g. ``"v5p-64"``, which names the chip), its chips and
    the JAX devices the programs were compiled for (v4: two devices, TensorCores, per chip)."""

    topology: str
    chips: int
    devices: int


@dataclasses.dataclass(frozen=True)
class Programs:
    """The compiled programs the bounds come from (``ProgramMemory`` with cost figures, per
    device).

    ``decode``: the decode chunk, its step loop counted once; ``prefill``: the prefill chunk, which
    takes ``prefill_tokens`` tokens on one device (its group's rows x chunk length);
    ``train_one``/``train_two``: the train step (every micro-batch) with 1 and 2 unrolled layers,
    to whose figures their splash kernels' cost (``splash_cost``) is added.
    """

    decode: Any
    prefill: Any
    prefill_tokens: int
    train_one: Any
    train_two: Any


@dataclasses.dataclass(frozen=True)
class Update:
    """The policy update of one RL step: ``mini_batches`` train steps, each compiled for
    ``micro_batches x micro_rows`` rows.

    ``useful_tokens``: the input positions per row the update runs, which the model FLOPs count
    (as one causal sequence per row); ``rows``: rows per mini-batch the update runs at the
    workload's mean lengths (packed, prompts shared when ``shared_prompts``:
    ``rl.packing.uniform_rows``; the compiled ``micro_batches x micro_rows`` when None), which
    scales the compiled train step's bound (its cost is linear in rows).
    """

    micro_batches: int
    micro_rows: int
    mini_batches: int
    useful_tokens: float
    rows: int | None = None
    shared_prompts: bool = False


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The rollout of one RL step, per data group (sampling-mesh row shard): its sequences over
    ``group_slots`` decode slots, ``prompts_per_group`` prompts of ``prompt_len`` tokens and
    ``mean_new`` new tokens per sequence.

    ``kv_heads``: KV heads a sampling device holds, ``cache_itemsize`` bytes per K/V element;
    ``weight_bytes``: the sampling weights one device reads per decode step.
    """

    sequences_per_group: int
    group_slots: int
    prompts_per_group: int
    prompt_len: int
    mean_new: float
    kv_heads: int
    cache_itemsize: int
    weight_bytes: int


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Speculative rollouts: ``verify``, the speculative decode chunk of ``draft_tokens`` drafts
    (``ProgramMemory``, its loop counted once: one verify step, reading the same K/V per slot as
    a decode step; a trie of them up to ``draft_depth`` deep, compiled on the
    ``verify_attention`` path), bounded at ``tokens_per_step`` tokens per verify step
    (``1 <= tokens_per_step <=`` the tokens one may emit: ``draft_tokens + 1``, a trie's
    ``draft_depth + 1``)."""

    verify: Any
    tokens_per_step: float
    draft_tokens: int
    draft_depth: int = 0
    verify_attention: str = ""


def estimate(
    mc,
    tpu: Slice,
    programs: Programs,
    update: Update,
    rollout: Rollout,
    steps: int,
    speculation: Speculation | None = None,
) -> StepTime:
    """The bounds of ``steps`` RL steps of model ``mc`` on ``tpu`` from its compiled
    ``programs`` (per device figures, see the module; the train step's splash kernels at
    ``mc.attention_block``), and of its rollout with ``speculation`` when given."""
    gen, peak, bandwidth = chip(tpu.topology)
    share = tpu.chips / tpu.devices  # v4: two devices (TensorCores) per chip
    peak, bandwidth = peak * share, bandwidth * share
    r = rollout
    context = r.prompt_len + r.mean_new / 2  # mean context of a decoded token
    kv = kv_bytes_per_token(mc, context, r.kv_heads, r.cache_itemsize)
    decode, prefill = programs.decode, programs.prefill
    step_flops = decode.flops
    step_bytes = decode.bytes_accessed + r.group_slots * kv
    rounds = -(-r.sequences_per_group // r.group_slots)
    decode_steps = rounds * math.ceil(r.mean_new)
    prefill_call = bound(prefill.flops, prefill.bytes_accessed, peak, bandwidth)
    per_token = prefill_call / programs.prefill_tokens
    one, two = programs.train_one, programs.train_two
    train_flops, train_bytes = _train_figures(one, two, mc.attention_block, mc.num_layers)
    compiled_rows = update.micro_batches * update.micro_rows
    rows = update.rows or compiled_rows
    model = train_model_flops(mc, rows, round(update.useful_tokens)) / tpu.devices
    run_s = bound(train_flops, train_bytes, peak, bandwidth) * rows / compiled_rows
    train_s = max(run_s, model / peak)  # the cost analysis can miss a kernel's FLOPs
    speculative = {}
    if speculation is not None:
        kv_bytes = r.group_slots * kv
        speculative = _verify_bound(speculation, rounds, r.mean_new, kv_bytes, peak, bandwidth)
    return StepTime(
        chip=gen,
        peak_flops=peak / share,
        hbm_bandwidth=bandwidth / share,
        mean_new_tokens=r.mean_new,
        decode_step_flops=step_flops,
        decode_step_bytes=step_bytes,
        decode_steps=decode_steps,
        decode_s=decode_steps * bound(step_flops, step_bytes, peak, bandwidth),
        prefill_s=r.prompts_per_group * r.prompt_len * per_token,
        train_flops=train_flops,
        train_bytes=train_bytes,
        train_model_flops=model,
        compiled_rows=compiled_rows,
        update_rows=rows,
        update_positions=rows * update.useful_tokens,
        shared_prompts=update.shared_prompts,
        update_s=update.mini_batches * train_s,
        update_mfu=model / peak / train_s,
        update_limit="HBM" if train_bytes / bandwidth > train_flops / peak else "FLOP/s",
        train_loops_once=one.loops_counted_once + two.loops_counted_once,
        bytes_per_token=step_bytes / r.group_slots,
        min_bytes_per_token=r.weight_bytes / r.group_slots + kv,
        steps=steps,
        chips=tpu.chips,
        **speculative,
    )


def _train_figures(train_one, train_two, attention_block: int, layers: int):
    """``(FLOPs, HBM bytes)`` of the ``layers``-layer train step: its 1- and 2-layer compiles,
    each with its splash kernels' cost, extrapolated."""
    (f1, b1), (f2, b2) = (splash_cost(t.splash, attention_block) for t in (train_one, train_two))
    one, two = train_one, train_two
    return (
        layers_extrapolated(one.flops + f1, two.flops + f2, layers),
        layers_extrapolated(one.bytes_accessed + b1, two.bytes_accessed + b2, layers),
    )


def _verify_bound(
    speculation: Speculation, rounds: int, mean_new: float, kv_bytes: float, peak, bandwidth
) -> dict:
    """The :class:`StepTime` fields of speculative rollouts: ``rounds`` rounds of ``mean_new``
    tokens at ``speculation.tokens_per_step`` per verify step, each step bounded by the verify
    chunk's figures plus the K/V its slots read (``kv_bytes``, as a decode step's)."""
    s = speculation
    longest = s.draft_depth or s.draft_tokens  # drafts a step may keep
    if not 1 <= s.tokens_per_step <= longest + 1:
        raise ValueError(
            f"tokens per verify step must be in [1, {longest + 1}] (the drafted tokens a "
            f"verify step may keep, plus one), got {s.tokens_per_step}"
        )
    steps = rounds * math.ceil(mean_new / s.tokens_per_step)
    nbytes = s.verify.bytes_accessed + kv_bytes
    return dict(
        draft_tokens=s.draft_tokens,
        draft_depth=s.draft_depth,
        verify_attention=s.verify_attention,
        tokens_per_step=s.tokens_per_step,
        verify_step_flops=s.verify.flops,
        verify_step_bytes=nbytes,
        verify_steps=steps,
        verify_s=steps * bound(s.verify.flops, nbytes, peak, bandwidth),
    )
