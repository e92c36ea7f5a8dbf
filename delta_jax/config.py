"""Run configuration: frozen dataclasses, YAML files with a base, and ``key=value`` overrides.

A config file is a YAML mapping of sections (``model``, ``data``, ``rollout``, ``reward``,
``algo``, ``optim``, ``run``). It may name a ``base:`` file (relative to itself) whose values it
overrides; bases chain. Command-line overrides are ``section.key=value`` strings parsed as YAML
scalars and checked against the field's type. Every mistake (unknown section or key, wrong type,
invalid choice) is a single-line :class:`ConfigError` naming the key and, for unknown keys, the
closest valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration mistake, described in one line."""


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass(frozen=True)
class ModelConfigSection:
    """Which policy to train.

    ``path`` is a Hugging Face directory (config.json + safetensors + tokenizer), a hub id such as
    ``Qwen/Qwen3-0.6B`` (downloaded on first use at ``revision``, then read from the cache;
    ``HF_HUB_OFFLINE=1`` for cache only), or ``demo:tiny`` for the built-in tiny model that the
    CPU demo warms up on its synthetic task before RL.
    """

    path: str = "demo:tiny"
    revision: str | None = None
    # LoRA (delta_jax.models.lora): rank 0 trains every weight; rank r > 0 freezes the base and
    # trains adapters of rank r on `lora_targets` (PEFT module names), scaled by alpha / r.
    lora_rank: int = 0
    lora_alpha: float = 32.0  # > 0
    lora_targets: tuple[LoraTarget, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    scan_layers: bool = False
    remat: Literal["none", "block", "matmuls", "full"] = "none"
    # Attention implementation (delta_jax.models.attention): auto | dense | chunked | splash |
    # cudnn, and the block length of chunked / splash.
    attention: Literal["auto", "dense", "chunked", "splash", "cudnn"] = "auto"
    attention_block: int = 512
    # Supervised warm-up of the demo model (ignored for real checkpoints): at most this many
    # steps (0: none, RL starts from the random initialisation), stopped early once the
    # held-out probability of the correct answer reaches `demo_warmup_target` (in [0, 1], checked
    # every 10 steps; None: all the steps). See delta_jax.demo.
    demo_warmup_steps: int = 800
    demo_warmup_lr: float = 3e-3
    demo_warmup_target: float | None = 0.1
    # Fraction of warm-up demonstrations with a corrupted answer (see delta_jax.demo).
    demo_warmup_noise: float = 0.0


@dataclasses.dataclass(frozen=True)
class DataConfigSection:
    """Prompts: a local file/directory, a hub data set (``openai/gsm8k`` with ``subset: main``;
    downloaded on first use through ``datasets``), or ``demo:arithmetic``."""

    source: str = "demo:arithmetic"
    subset: str | None = None
    # Response template of the demo task (delta_jax.demo.TEMPLATES): formatting density.
    demo_template: Literal["short", "long"] = "short"
    adapter: str = "generic"
    split: str = "train"
    eval_source: str | None = None
    eval_split: str = "test"
    max_prompt_length: int = 16
    truncation: Literal["drop", "left"] = "drop"
    template: str | None = None
    system_prompt: str | None = None
    on_bad_row: Literal["error", "skip"] = "error"
    shuffle: bool = True
    limit: int | None = None  # at most this many rows (>= 1); None: all


@dataclasses.dataclass(frozen=True)
class RolloutConfigSection:
    """Sampling: how many prompts and responses per RL step, and how they are drawn."""

    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # "continuous": slots refilled as rows end, over a paged KV cache (delta_jax.sampling.engine);
    # "static": one batch decoded until its longest row ends.
    engine: Literal["continuous", "static"] = "continuous"
    # Sequences decoded at once by the continuous engine, in total: split evenly over the
    # sampling mesh's data groups (each runs its own slots and pool share; a prompt's samples
    # stay in one group, so samples_per_prompt must fit one group's slots).
    decode_slots: int = 64
    page_size: int = 16  # tokens per KV page (continuous engine)
    # KV pages in the engine's pool in total (one scratch page per data group included), split
    # evenly over the groups; 0: per group, its slots x the longest sequence's pages + 1, never
    # short. A smaller pool preempts and requeues sequences instead.
    num_pages: int = 0
    # Dynamic sampling (DAPO): resample until the batch holds `prompts_per_step` groups whose
    # rewards are not all equal, at most this many extra sampling rounds (0 disables). The
    # built-in defaults are the CPU demo's; paper_base.yaml sets 0.
    dynamic_sampling_rounds: int = 2
    # Model turns per episode: 1 single-turn; > 1 multi-turn (a sequence waiting on a tool
    # keeps its KV pages, so the default pool holds every sequence of the step).
    max_turns: int = 1


@dataclasses.dataclass(frozen=True)
class RewardConfigSection:
    """Verifiable reward: ``math``, ``code``, ``format`` or ``package.module:function``."""

    kind: str = "math"
    # Worker processes; 0 scores serially in the trainer's process (no deadline, no isolation).
    num_workers: int = 2
    timeout_s: float = 5.0  # per item, > 0
    # DAPO soft overlong punishment, in tokens (buffer 0 disables it; at most
    # rollout.max_new_tokens), and its largest penalty (>= 0).
    overlong_buffer: int = 0
    overlong_factor: float = 1.0
    # Reward noise: this fraction of training rewards (chosen at random, reproducibly) is
    # flipped r -> 1 - r before advantages; evaluation rewards are never flipped.
    flip_fraction: float = 0.0


LossName = Literal["delta", "dapo", "grpo", "dr_grpo", "gspo", "sapo", "dapo_forking_tokens"]


@dataclasses.dataclass(frozen=True)
class AlgoConfigSection:
    """The policy-gradient objective (see ``delta_jax.rl.objectives`` for each loss preset)."""

    loss: LossName = "delta"
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = "grpo"
    # Overrides of the preset's surrogate settings; None keeps the preset's value. The clip range
    # is [1 - low, 1 + high] (low in [0, 1], high >= 0); dual_clip_c > 1 (None: no dual clip).
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    dual_clip_c: float | None = 10.0
    aggregation: (
        Literal[
            "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
        ]
        | None
    ) = None
    # DelTA (DELTA_SPEC §3/§6).
    refine_steps: int = 1
    lam_min: float = 0.8
    lam_max: float = 1.2
    delta_assignment: Literal["soft", "hard"] = "soft"
    delta_adaptive_gamma: bool = True
    delta_range_map: bool = True
    delta_normalize: Literal["sum", "count"] = "sum"
    delta_scope: Literal["global", "per_shard"] = "global"
    forking_top_q: float = 0.2
    kl_coef: float = 0.0  # >= 0; 0: no KL term (and no reference pass)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0  # >= 0; 0: no entropy bonus
    # Truncated importance sampling against the sampler's log-probs: weights capped at this
    # value (> 0; None disables).
    tis_cap: float | None = None
    # Optimiser updates per rollout batch (DELTA_SPEC §7: 4), and gradient-accumulation
    # micro-batches per update.
    mini_batches: int = 1
    micro_batches: int = 1
    # Pack prompt+response sequences first-fit-decreasing into rows of `tokens_per_row` input
    # positions for the update (false: one sequence per row, padded to the longest possible).
    packing: bool = True
    # None: the longest possible sequence, data.max_prompt_length + rollout.max_new_tokens - 1.
    tokens_per_row: int | None = None


@dataclasses.dataclass(frozen=True)
class OptimConfigSection:
    """AdamW with global-norm clipping and a constant or warmup+cosine schedule."""

    lr: float = 2e-4  # > 0
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0  # linear warm-up updates, >= 0 (0: none)
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr, in [0, 1]
    weight_decay: float = 0.0  # >= 0
    grad_clip: float = 1.0  # global-norm bound, >= 0 (0: no clipping)
    b1: float = 0.9  # in [0, 1)
    b2: float = 0.999  # in [0, 1)
    eps: float = 1e-8  # > 0


@dataclasses.dataclass(frozen=True)
class RunConfigSection:
    """Where the run writes, how long it runs and how often it saves and evaluates."""

    dir: str = "runs/demo"
    steps: int = 100
    seed: int = 0  # >= 0
    # Checkpoint every this many steps; 0: no periodic checkpoints. The last step and a step
    # stopped by SIGTERM are always saved (see `save_due`), so a finished or stopped run resumes.
    save_every: int = 20
    keep_last: int = 2  # most recent checkpoints kept (>= 1), plus the best by `best_metric`
    best_metric: str = "reward_mean"
    eval_every: int = 20  # evaluate every this many steps (and before step 1); 0: never
    eval_prompts: int = 512  # >= 1
    tensorboard: bool = True
    wandb: bool = False
    progress: bool = True
    # Optional device mesh (data, fsdp, tensor); -1 takes the remaining devices.
    mesh: tuple[int, int, int] = (-1, 1, 1)

    def save_due(self, step: int, stopping: bool = False) -> bool:
        """Whether the loop saves a checkpoint at the end of ``step``."""
        periodic = self.save_every > 0 and step % self.save_every == 0
        return periodic or step == self.steps or stopping


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run's configuration. The defaults are the built-in CPU demo (configs/demo.yaml)."""

    model: ModelConfigSection = ModelConfigSection()
    data: DataConfigSection = DataConfigSection()
    rollout: RolloutConfigSection = RolloutConfigSection()
    reward: RewardConfigSection = RewardConfigSection()
    algo: AlgoConfigSection = AlgoConfigSection()
    optim: OptimConfigSection = OptimConfigSection()
    run: RunConfigSection = RunConfigSection()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Section name -> section dataclass (annotations are strings under `from __future__`).
_SECTIONS: dict[str, type] = typing.get_type_hints(Config)
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _closest(name: str, choices: Sequence[str], prefix: str = "") -> str:
    choices = [prefix + c for c in choices]
    close = difflib.get_close_matches(prefix + name, choices, n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else f"; valid: {', '.join(choices)}"


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to the annotated type ``tp``, or raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple) or not value:
            raise ConfigError(f"{key}={value!r} must be a non-empty list")
        return tuple(_check_value(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key}={value!r} must be a list of {len(args)} values")
        pairs = enumerate(zip(value, args, strict=True))
        return tuple(_check_value(f"{key}[{i}]", v, a) for i, (v, a) in pairs)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        # YAML 1.1 reads `1e-6` (no dot) as a string; accept numeric strings only.
        if isinstance(value, str) and _NUMBER.match(value):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"{key}={value!r} must be a string")
        return str(value)
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def _merge(base: dict[str, Any], override: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = {k: dict(v) for k, v in base.items()}
    for section, values in override.items():
        if section not in _SECTIONS:
            raise ConfigError(f"{where}: unknown section {section!r}{_closest(section, _SECTIONS)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where}: section {section!r} must be a mapping")
        out.setdefault(section, {}).update(values)
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: circular 'base:' chain")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base_name = raw.pop("base", None)
    merged: dict[str, Any] = {}
    if base_name is not None:
        merged = _read_yaml(path.parent / base_name, (*seen, path))
    return _merge(merged, raw, str(path))


def build_config(values: Mapping[str, Mapping[str, Any]], where: str = "config") -> Config:
    """Validate a nested mapping of section -> key -> value into a :class:`Config`."""
    sections = {}
    for section, tp in _SECTIONS.items():
        given = dict(values.get(section, {}))
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for key, value in given.items():
            if key not in hints:
                raise ConfigError(
                    f"{where}: unknown key {section}.{key}{_closest(key, hints, f'{section}.')}"
                )
            kwargs[key] = _check_value(f"{section}.{key}", value, hints[key])
        sections[section] = tp(**kwargs)
    for section in values:
        if section not in _SECTIONS:
            raise ConfigError(f"{where}: unknown section {section!r}{_closest(section, _SECTIONS)}")
    config = Config(**sections)
    validate(config)
    return config


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.key=value`` into its parts, the value parsed as a YAML scalar."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    if dotted.count(".") != 1:
        raise ConfigError(f"override {text!r}: the key must be section.key (e.g. algo.loss=dapo)")
    section, key = dotted.split(".")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw  # e.g. an unbalanced bracket: the field's type check reports it
    return section, key, value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config (with its ``base:`` chain) and apply ``section.key=value`` overrides.

    Args:
      path: a YAML file, or None for the built-in defaults (the CPU demo).
      overrides: strings such as ``algo.loss=dapo`` or ``run.steps=10``.

    Returns:
      The validated, frozen :class:`Config`.

    Raises:
      ConfigError: one line naming the bad key or value.
    """
    values: dict[str, Any] = {} if path is None else _read_yaml(Path(path))
    for text in overrides:
        section, key, value = parse_override(text)
        values = _merge(values, {section: {key: value}}, f"override {text!r}")
    return build_config(values, where=str(path) if path else "config")


def validate(config: Config) -> None:
    """Cross-field checks that single field types cannot express."""
    r, a, o, run = config.rollout, config.algo, config.optim, config.run
    positive = {
        "rollout.prompts_per_step": r.prompts_per_step,
        "rollout.samples_per_prompt": r.samples_per_prompt,
        "rollout.max_new_tokens": r.max_new_tokens,
        "rollout.decode_slots": r.decode_slots,
        "rollout.page_size": r.page_size,
        "algo.mini_batches": a.mini_batches,
        "algo.micro_batches": a.micro_batches,
        "run.steps": run.steps,
        "data.max_prompt_length": config.data.max_prompt_length,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    if r.num_pages < 0:
        raise ConfigError(f"rollout.num_pages={r.num_pages} must be >= 0 (0: sized by the engine)")
    _check_ranges(config)
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
    if not 0.0 <= config.reward.flip_fraction <= 1.0:
        raise ConfigError(f"reward.flip_fraction={config.reward.flip_fraction} must be in [0, 1]")
    if r.temperature < 0:
        raise ConfigError(f"rollout.temperature={r.temperature} must be >= 0")
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if r.top_k < 0:
        raise ConfigError(f"rollout.top_k={r.top_k} must be >= 0")
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
    if a.lam_min > a.lam_max or a.lam_min < 0:
        raise ConfigError(
            f"algo.lam_min={a.lam_min} / algo.lam_max={a.lam_max}: need 0 <= min <= max"
        )
    longest = config.data.max_prompt_length + r.max_new_tokens - 1
    if a.tokens_per_row is not None and a.tokens_per_row < longest:
        raise ConfigError(
            f"algo.tokens_per_row={a.tokens_per_row} must hold the longest sequence "
            f"(data.max_prompt_length + rollout.max_new_tokens - 1 = {longest})"
        )
    if a.refine_steps < 0:
        raise ConfigError(f"algo.refine_steps={a.refine_steps} must be >= 0")
    if not 0.0 < a.forking_top_q <= 1.0:
        raise ConfigError(f"algo.forking_top_q={a.forking_top_q} must be in (0, 1]")
    if o.lr <= 0:
        raise ConfigError(f"optim.lr={o.lr} must be > 0")
    if r.samples_per_prompt < 2 and a.advantage in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        raise ConfigError(
            f"rollout.samples_per_prompt={r.samples_per_prompt}: group advantages need >= 2 samples"
        )


# Numeric ranges: key -> (lowest, highest, whether each bound is included); None: unbounded;
# `null` is always allowed for an Optional field. Keys with a meaning for 0 say so in the fields.
_RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "model.lora_rank": (0, None, True, True),
    "model.lora_alpha": (0, None, False, True),
    "model.attention_block": (1, None, True, True),
    "model.demo_warmup_steps": (0, None, True, True),
    "model.demo_warmup_lr": (0, None, False, True),
    "model.demo_warmup_target": (0, 1, True, True),
    "model.demo_warmup_noise": (0, 1, True, True),
    "data.limit": (1, None, True, True),
    "rollout.dynamic_sampling_rounds": (0, None, True, True),
    "rollout.max_turns": (1, None, True, True),
    "reward.num_workers": (0, None, True, True),
    "reward.timeout_s": (0, None, False, True),
    "reward.overlong_buffer": (0, None, True, True),
    "reward.overlong_factor": (0, None, True, True),
    "algo.clip_eps_low": (0, 1, True, True),
    "algo.clip_eps_high": (0, None, True, True),
    "algo.dual_clip_c": (1, None, False, True),
    "algo.tis_cap": (0, None, False, True),
    "algo.kl_coef": (0, None, True, True),
    "algo.entropy_coef": (0, None, True, True),
    "optim.warmup_steps": (0, None, True, True),
    "optim.min_lr_ratio": (0, 1, True, True),
    "optim.weight_decay": (0, None, True, True),
    "optim.grad_clip": (0, None, True, True),
    "optim.b1": (0, 1, True, False),
    "optim.b2": (0, 1, True, False),
    "optim.eps": (0, None, False, True),
    "run.seed": (0, None, True, True),
    "run.save_every": (0, None, True, True),
    "run.keep_last": (1, None, True, True),
    "run.eval_every": (0, None, True, True),
    "run.eval_prompts": (1, None, True, True),
}


def _check_ranges(config: Config) -> None:
    for key, (lo, hi, lo_in, hi_in) in _RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value is None:
            continue
        low_ok = lo is None or (value >= lo if lo_in else value > lo)
        high_ok = hi is None or (value <= hi if hi_in else value < hi)
        if not (low_ok and high_ok):
            if hi is None:
                bound = f">= {lo}" if lo_in else f"> {lo}"
            else:
                bound = f"in {'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
            raise ConfigError(f"{key}={value} must be {bound}")
    mesh = config.run.mesh
    if mesh.count(-1) > 1 or any(m == 0 or m < -1 for m in mesh):
        raise ConfigError(
            f"run.mesh={list(mesh)}: each entry must be >= 1, or -1 (the remaining devices) "
            "for at most one"
        )
