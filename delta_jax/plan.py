"""Memory planner: will this run fit a TPU slice, and with what micro-batch?

``delta-jax plan --config configs/qwen3_8b_delta.yaml --topology v5p-64`` builds the model
abstractly (``nnx.eval_shape``, no weights allocated), lowers and compiles the run's train step
and its sampler program for the real shapes, and reads each program's per-device memory from the
compiler's buffer assignment (``compiled.memory_analysis()``). Two compilers:

* the TPU compiler (when ``libtpu`` is importable: ``pip install "delta-jax[tpu]"``): the programs
  are compiled, compile-only, for the slice's real topology
  (``jax.experimental.topologies.get_topology_desc``), no TPU attached; the figures are what the
  TPU program needs (Pallas kernels such as splash attention included);
* otherwise XLA:CPU on stand-in devices (one fake CPU device per chip): an estimate.

The figures:

* parameters and optimiser state: exact, from the shardings (``delta_jax.sharding``);
* train step: arguments + outputs - donated aliases + temporaries (activations, gradients);
* sampler: its parameters (resharded copy where the sampling rules differ), KV cache (exact, from
  the cache shape) and temporaries, on top of the train state that stays resident while sampling.

Then it searches the largest micro-batch (rows per gradient-accumulation step) and the largest
number of prompts per sampler call that fit in the chip's HBM (times ``headroom``).

Parameter, optimiser and KV-cache bytes are exact (shapes and shardings). Temporaries depend on
the compiler's fusion and layout decisions: from the TPU compiler they are the TPU's; from
XLA:CPU an estimate (and XLA:CPU runs Pallas TPU kernels in interpret mode, so ``auto``
attention plans as ``chunked`` there).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import importlib.util
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import xla_bridge  # backends_are_initialized: no public equivalent
from jax.sharding import NamedSharding

from delta_jax import sharding as sh
from delta_jax.models import ModelConfig, Transformer, lora
from delta_jax.models.axes import logical_to_mesh
from delta_jax.models.hf import model_config_file
from delta_jax.models.transformer import KEY_CACHE_AXES, VALUE_CACHE_AXES
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.rl.train_step import abstract_batch, make_train_step
from delta_jax.rl.update_plan import UpdatePlan
from delta_jax.sampling import sampler as sampler_lib
from delta_jax.sampling.buckets import Buckets, prepare_request
from delta_jax.sampling.engine import lower_decode, pages_for, prefill_chunk
from delta_jax.sampling.paged import PAGE_AXES, PageList, PagePool
from delta_jax.sampling.strategies import make_strategy

_GiB = 1024**3

# Public hyper-parameters (config.json on the Hugging Face hub) of models the planner knows
# without a local copy; a local directory or cached hub id is read instead when present.
# name: (hidden H, mlp F, layers L, heads N, kv heads K, tied embeddings); all Qwen3 share the rest.
_QWEN3_SHAPES = {
    "Qwen3-0.6B": (1024, 3072, 28, 16, 8, True),
    "Qwen3-1.7B": (2048, 6144, 28, 16, 8, True),
    "Qwen3-4B": (2560, 9728, 36, 32, 8, True),
    "Qwen3-8B": (4096, 12288, 36, 32, 8, False),
    "Qwen3-14B": (5120, 17408, 40, 40, 8, False),
}
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    name: dict(
        family="qwen3",
        vocab_size=151936,
        hidden_size=H,
        intermediate_size=F,
        num_layers=L,
        num_heads=N,
        num_kv_heads=K,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        qk_norm=True,
        max_position_embeddings=32768,
        tie_word_embeddings=tied,
        bos_token_id=151643,
        eos_token_id=151643,
    )
    for name, (H, F, L, N, K, tied) in _QWEN3_SHAPES.items()
}


def known_model_config(name: str, **runtime):
    """``ModelConfig`` of a known model by hub id (``Qwen/Qwen3-8B-Base``) or short name."""
    short = name.rstrip("/").split("/")[-1].removesuffix("-Base")
    if short not in KNOWN_MODELS:
        raise ValueError(
            f"model {name!r} is not a local directory or cached hub id, and not one "
            f"of the planner's known models {sorted(KNOWN_MODELS)}"
        )
    return ModelConfig(**KNOWN_MODELS[short], **runtime)


def resolve_model_config(config):
    """The run's ``ModelConfig``: local/cached ``config.json``, demo model, or a known model."""
    m = config.model
    runtime = dict(
        scan_layers=m.scan_layers,
        remat=m.remat,
        attention=m.attention,
        attention_block=m.attention_block,
    )
    if m.path == "demo:tiny":
        return ModelConfig.tiny("qwen3", **runtime)
    try:  # config.json only: the planner never downloads weights
        return ModelConfig.from_hf(model_config_file(m.path, revision=m.revision), **runtime)
    except FileNotFoundError:
        return known_model_config(m.path, **runtime)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program (XLA buffer assignment).

    ``out_of_memory``: the TPU compiler refused the program (it does not fit the chip's HBM);
    ``temporaries`` is then the requirement its error message states and the other fields are 0,
    so ``peak`` is a lower bound.
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    compile_s: float
    out_of_memory: bool = False

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @classmethod
    def of(cls, compiled, compile_s: float) -> ProgramMemory:
        stats = compiled.memory_analysis()
        return cls(
            arguments=int(stats.argument_size_in_bytes),
            outputs=int(stats.output_size_in_bytes),
            aliased=int(stats.alias_size_in_bytes),
            temporaries=int(stats.temp_size_in_bytes),
            compile_s=compile_s,
        )


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """What :func:`plan` found; every byte figure is per device (chip).

    The sampler is the rollout's: the continuous engine (``decode_slots`` sequences over a pool
    of ``num_pages`` KV pages; ``sampler`` is its decode chunk, ``prefill`` its largest prefill
    chunk) or the static sampler (``sampler`` is its one program, ``prefill`` None); both on the
    sampling mesh with the weights in the sampling layout (``reshard``: the per-update move).
    """

    topology: str
    chips: int
    hbm_bytes: int
    headroom: float
    compiler: str
    mesh: dict[str, int]
    sample_mesh: dict[str, int]
    model: str
    params_bytes: int
    opt_state_bytes: int
    micro_batch_rows: int
    train: ProgramMemory
    engine: str
    sampler_prompts: int
    samples_per_prompt: int
    cache_slots: int  # static: cache length; engine: decode slots
    num_pages: int  # engine: pages in the pool (scratch included); static: 0
    page_size: int
    kv_cache_bytes: int  # static: the KV cache; engine: the page pool
    sampler_params_bytes: int
    shared_params_bytes: int  # trainer's parameter bytes the sampler reads in place (not moved)
    sampler: ProgramMemory
    prefill: ProgramMemory | None
    reshard: ProgramMemory
    reshard_collective_bytes: int
    max_micro_batch_rows: int | None
    max_sampler_size: int | None  # static: prompts per call; engine: decode slots
    train_compiled: bool = True  # False: --skip-train (train figures are zero)

    @property
    def budget(self) -> int:
        return int(self.hbm_bytes * self.headroom)

    @property
    def train_peak(self) -> int:
        return self.train.peak

    @property
    def sampler_peak(self) -> int:
        return max(self.sampler.peak, self.prefill.peak if self.prefill else 0)

    @property
    def sampling_peak(self) -> int:
        # The train state stays resident while sampling; the sampler's own argument bytes
        # already hold its parameters: a resharded copy of the leaves that move, the trainer's
        # own buffers for the rest (e.g. a bfloat16 LoRA base on one chip), counted once.
        shared = 0 if self.sampler.out_of_memory else self.shared_params_bytes
        return self.params_bytes + self.opt_state_bytes + self.sampler_peak - shared

    @property
    def fits(self) -> bool:
        return max(self.train_peak, self.sampling_peak) <= self.budget

    @property
    def headroom_bytes(self) -> int:
        """Budget left at the larger of the two peaks (negative: does not fit)."""
        return self.budget - max(self.train_peak, self.sampling_peak)

    def table(self) -> str:
        """The report as an aligned text table (GiB per device, and where each figure is from)."""
        g = lambda b: f"{b / _GiB:8.2f}"
        mesh = lambda m: " x ".join(f"{k}={v}" for k, v in m.items())
        exact, comp = "exact (shapes x shardings)", self.compiler_name
        row = lambda label, b, src: f"{label:<40}{g(b)}  {src}"
        oom = " (TPU compiler: out of memory, a lower bound)"
        train_src = comp + (oom if self.train.out_of_memory else "")
        train_src = train_src if self.train_compiled else "not compiled (--skip-train)"
        sampler_src = comp + (oom if self.sampler.out_of_memory else "")
        if self.engine == "continuous":
            tokens = (self.num_pages - 1) * self.page_size
            head = (
                f"sampler: continuous engine, {self.cache_slots} decode slots, page pool "
                f"{self.num_pages} pages x {self.page_size} tokens ({tokens} tokens); "
                f"{self.sampler_prompts} prompts x {self.samples_per_prompt} samples per step:"
            )
            cache = row("  KV page pool", self.kv_cache_bytes, exact)
            temps = [
                row("  sampler temporaries (decode chunk)", self.sampler.temporaries, sampler_src),
                row("  sampler temporaries (prefill chunk)", self.prefill.temporaries, comp),
            ]
            largest = f"largest decode_slots that fits: {_rows(self.max_sampler_size, 'slots')}"
        else:
            head = (
                f"sampler: static, {self.sampler_prompts} prompts x {self.samples_per_prompt} "
                f"samples, {self.cache_slots} cache slots:"
            )
            cache = row("  KV cache", self.kv_cache_bytes, exact)
            temps = [row("  sampler temporaries (incl. KV cache)", self.sampler.temporaries,
                         sampler_src)]  # fmt: skip
            largest = f"largest sampler call that fits: {_rows(self.max_sampler_size, 'prompts')}"
        lines = [
            f"{self.model} on {self.topology} ({self.chips} devices, {self.hbm_bytes / _GiB:.0f} "
            f"GiB HBM each; budget {self.headroom:.0%} = {self.budget / _GiB:.1f} GiB); train "
            f"mesh {mesh(self.mesh)}, sampling mesh {mesh(self.sample_mesh)}",
            f"compiler: {self.compiler}",
            f"{'per device':<40}{'GiB':>8}  source",
            row("parameters (train placement)", self.params_bytes, exact),
            row("optimizer state", self.opt_state_bytes, exact),
            f"train step, micro-batch {self.micro_batch_rows} rows:",
            row("  train temporaries", self.train.temporaries, train_src),
            row("  peak (state + batch + temporaries)", self.train_peak, train_src),
            head,
            cache,
            row("  parameters (sampling layout)", self.sampler_params_bytes, exact),
            *temps,
            row("  peak (+ resident train state)", self.sampling_peak, sampler_src),
            row("headroom (budget - larger peak)", self.headroom_bytes, comp),
            f"fits: {'YES' if self.fits else 'NO'} (train "
            f"{f'{self.train_peak / self.budget:.0%}' if self.train_compiled else 'not compiled'}"
            f", sampling {self.sampling_peak / self.budget:.0%} of budget)",
            f"weights to the sampling layout, per update: {g(self.reshard_collective_bytes)} GiB "
            f"through collectives, {g(self.reshard.temporaries)} GiB temporaries ({comp})",
            f"largest micro-batch that fits: {_rows(self.max_micro_batch_rows, 'rows')}",
            largest,
            f"compile time: train {self.train.compile_s:.1f}s, sampler "
            f"{self.sampler.compile_s + (self.prefill.compile_s if self.prefill else 0):.1f}s "
            f"({comp})",
        ]
        return "\n".join(lines)

    @property
    def compiler_name(self) -> str:
        return "TPU compiler" if self.compiler.startswith("TPU") else "XLA:CPU estimate"


def _rows(value: int | None, unit: str) -> str:
    if value is None:
        return "not searched"
    return f"{value} {unit}" if value > 0 else "none (even the smallest does not fit)"


def _sharded_bytes(tree: Any, shardings: Any) -> int:
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        total += math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
    return total


class _Planner:
    """Builds and compiles the run's programs for one mesh; caches nothing but the setup."""

    def __init__(self, config, mesh, model_config):
        self.config, self.mesh, self.model_config = config, mesh, model_config
        m = config.model
        dtype, param_dtype = jnp.dtype(m.dtype), jnp.dtype(m.param_dtype)

        def build():
            model = Transformer(model_config, dtype=dtype, param_dtype=param_dtype)
            if m.lora_rank:  # adapters only train: optimiser state for them alone
                lora.add_adapters(
                    model, rank=m.lora_rank, alpha=m.lora_alpha, targets=m.lora_targets
                )
            return model

        abstract_model = nnx.eval_shape(build)
        self.graphdef, self.params, self.rest = nnx.split(abstract_model, nnx.Param, ...)
        self.optimizer = make_optimizer(config.optim, total_updates=max(config.run.steps, 1))
        self.state = jax.eval_shape(lambda p: init_train_state(p, self.optimizer), self.params)
        self.state_shardings = sh.state_shardings(self.state, mesh)
        self.param_shardings = sh.param_shardings(self.params, mesh)
        # The rollout's layout (rl.loop): tensor-parallel regrouping, compute-dtype weights.
        self.sample_mesh = sh.sampling_mesh(mesh, model_config.num_kv_heads)
        self.sample_shardings = sh.param_shardings(self.params, self.sample_mesh, sh.SAMPLE_RULES)
        self.sample_dtypes = [
            sh._sampling_dtype(x.dtype, dtype) for x in jax.tree.leaves(self.params)
        ]
        self.update_plan = UpdatePlan.from_config(config)

    def params_bytes(self) -> int:
        return _sharded_bytes(self.params, self.param_shardings)

    def opt_state_bytes(self) -> int:
        opt = self.state.opt_state
        shardings = self.state_shardings.opt_state
        return _sharded_bytes(opt, shardings) if jax.tree.leaves(opt) else 0

    def _moved(self) -> list[int]:
        """Leaves whose sampling layout (placement or dtype) differs from the trainer's."""
        return [
            i
            for i, (x, s, t, d) in enumerate(
                zip(
                    jax.tree.leaves(self.params),
                    jax.tree.leaves(self.param_shardings),
                    jax.tree.leaves(self.sample_shardings),
                    self.sample_dtypes,
                    strict=True,
                )
            )
            if s != t or d != x.dtype
        ]

    def sampler_params_bytes(self) -> int:
        """Per-device bytes of the sampling copy (0: the sampler reads the trainer's buffers)."""
        leaves, targets = jax.tree.leaves(self.params), jax.tree.leaves(self.sample_shardings)
        return sum(
            math.prod(targets[i].shard_shape(leaves[i].shape)) * self.sample_dtypes[i].itemsize
            for i in self._moved()
        )

    def shared_params_bytes(self) -> int:
        """Per-device bytes of the trainer's parameters the sampler reads in place."""
        moved = set(self._moved())
        leaves, shardings = jax.tree.leaves(self.params), jax.tree.leaves(self.param_shardings)
        return sum(
            math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
            for i, (x, s) in enumerate(zip(leaves, shardings, strict=True))
            if i not in moved
        )

    def reshard(self) -> tuple[ProgramMemory, int]:
        """Compiles the per-update move of the trainer's weights into the sampling layout.

        Returns its memory and the bytes its collectives produce per device (the traffic of one
        weight update's reshard, from the compiled program's collectives).
        """
        moved = self._moved()
        if not moved:
            return ProgramMemory(0, 0, 0, 0, 0.0), 0
        leaves = jax.tree.leaves(self.params)
        sources, targets = (
            jax.tree.leaves(self.param_shardings),
            jax.tree.leaves(self.sample_shardings),
        )
        args = [
            jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype, sharding=sources[i])
            for i in moved
        ]
        program = sh._resharder(
            tuple(targets[i] for i in moved), tuple(self.sample_dtypes[i] for i in moved)
        )
        start = time.perf_counter()
        compiled = program.lower(*args).compile()
        return ProgramMemory.of(compiled, time.perf_counter() - start), _collective_bytes(
            compiled.as_text()
        )

    def train(self, rows: int) -> ProgramMemory:
        """Compiles the train step for micro-batches of ``rows`` rows (global).

        Rows are sequences (padded layout) or packed rows of ``algo.tokens_per_row`` (at most one
        per sequence), and the batch carries the fields the update plan feeds it.
        """
        batch = abstract_batch(self.update_plan, rows, sh.batch_sharding(self.mesh))
        step = make_train_step(
            self.graphdef,
            self.optimizer,
            self.update_plan,
            mesh=self.mesh,
            jit_kwargs=sh.train_jit_kwargs(self.state, self.mesh),
        )
        return _compile(lambda: step.lower(self.state, batch), self.mesh, sh.TRAIN_RULES)

    def _request(self, prompts: int):
        c, mc = self.config, self.model_config
        request = prepare_request(
            [[1] * c.data.max_prompt_length] * prompts,
            max_new_tokens=c.rollout.max_new_tokens,
            n=c.rollout.samples_per_prompt,
            stop_token_ids=[0],
            vocab_size=mc.vocab_size,
            pad_id=0,
            buckets=Buckets(),
            max_cache_length=mc.max_position_embeddings,
            row_multiple=sh.batch_divisor(self.sample_mesh, sh.SAMPLE_RULES),
        )
        rows = request.prompt_ids.shape[0] * c.rollout.samples_per_prompt
        return request, rows, request.prompt_ids.shape[1], request.gen_len

    def cache_dtype(self):
        kind = self.config.rollout.cache_dtype
        # On a TPU "auto" is bfloat16 (the sampler's default off CPU).
        return jnp.dtype(jnp.bfloat16 if kind == "auto" else kind)

    def _sample_params(self):
        return jax.tree.map(
            lambda x, s, d: jax.ShapeDtypeStruct(x.shape, d, sharding=s),
            self.params,
            self.sample_shardings,
            jax.tree.unflatten(jax.tree.structure(self.params), self.sample_dtypes),
        )

    # ---- the continuous engine (rollout.engine: continuous) -----------------------------------

    def engine_spec(self, slots: int):
        """The engine's static configuration for the run's request, as the rollout builds it."""
        from delta_jax.sampling import Sampler

        c = self.config
        sampler = Sampler(
            nnx.merge(self.graphdef, self.params, self.rest),
            mesh=self.sample_mesh,
            engine="continuous",
            decode_slots=slots,
            page_size=c.rollout.page_size,
            num_pages=c.rollout.num_pages or None,
        )
        request, *_ = self._request(c.rollout.prompts_per_step)
        return sampler.engine_spec(request, c.rollout.samples_per_prompt, False)

    def pool_bytes(self, spec) -> int:
        """Per-device bytes of the engine's page pool (``PAGE_AXES`` on the sampling mesh)."""
        mc = self.model_config
        shape = (spec.num_pages, spec.page_size, 2 * mc.num_kv_heads, mc.head_dim)
        pool = logical_to_mesh(PAGE_AXES, sh.SAMPLE_RULES, self.sample_mesh, shape)
        per_layer = math.prod(NamedSharding(self.sample_mesh, pool).shard_shape(shape))
        return mc.num_layers * per_layer * self.cache_dtype().itemsize

    def engine(self, spec) -> tuple[ProgramMemory, ProgramMemory]:
        """Compiles the engine's decode chunk and its largest prefill chunk for ``spec``."""
        mc, compute = self.model_config, jnp.dtype(self.config.model.dtype)
        list_pages = 1 if spec.attention == "pallas" else _pow2(spec.slots * spec.max_table)
        decode = _compile(
            lambda: lower_decode(
                mc,
                self.sample_mesh,
                sh.SAMPLE_RULES,
                slots=spec.slots,
                steps=spec.steps,
                page_size=spec.page_size,
                num_pages=spec.num_pages,
                table_pages=spec.max_table,
                list_pages=list_pages,
                dtype=compute,
                cache_dtype=self.cache_dtype(),
                attention=spec.attention,
            ),
            self.sample_mesh,
            sh.SAMPLE_RULES,
        )
        return decode, _compile(
            lambda: self._lower_prefill(spec), self.sample_mesh, sh.SAMPLE_RULES
        )

    def _lower_prefill(self, spec):
        """The engine's prefill program at its largest: the last chunk of the longest prompts."""
        mc, mesh = self.model_config, self.sample_mesh
        _, _, prompt_len, _ = self._request(self.config.rollout.prompts_per_step)
        rows = spec.prefill_rows
        T = min(spec.prefill_len, max(spec.min_len, _pow2(prompt_len)))
        listed = _pow2(rows * pages_for(-(-prompt_len // T) * T, spec.page_size))

        def aval(shape, dtype, names):
            names = names + (None,) * (len(shape) - len(names))
            where = NamedSharding(mesh, logical_to_mesh(names, sh.SAMPLE_RULES, mesh, shape))
            return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

        page = (spec.num_pages, spec.page_size, 2 * mc.num_kv_heads, mc.head_dim)
        pool = PagePool(
            kv=tuple(aval(page, self.cache_dtype(), PAGE_AXES) for _ in range(mc.num_layers))
        )
        pages = PageList(
            **{k: aval((listed,), jnp.int32, (None,)) for k in ("page", "seq", "index")}
        )
        args = (
            self._sample_params(),
            self.rest,
            pool,
            aval((rows, T), jnp.int32, ("batch",)),
            aval((rows, T), jnp.int32, ("batch",)),
            aval((rows, T), jnp.bool_, ("batch",)),
            pages,
        )
        fn = functools.partial(prefill_chunk, graphdef=self.graphdef)
        return jax.jit(fn, donate_argnums=(2,)).lower(*args)

    # ---- the static sampler (rollout.engine: static) ------------------------------------------

    def kv_cache_bytes(self, prompts: int) -> int:
        """Per-device bytes of the static sampler's cache, in the model's layout (one K and one
        V buffer per layer, ``KEY_CACHE_AXES`` / ``VALUE_CACHE_AXES``)."""
        mc, mesh = self.model_config, self.sample_mesh
        _, rows, P, G = self._request(prompts)
        B, K, D, S = rows, mc.num_kv_heads, mc.head_dim, P + G
        total = 0
        for names, shape in ((KEY_CACHE_AXES, (B, K, D, S)), (VALUE_CACHE_AXES, (B, K, S, D))):
            spec = logical_to_mesh(names, sh.SAMPLE_RULES, mesh, shape)
            total += math.prod(NamedSharding(mesh, spec).shard_shape(shape))
        return mc.num_layers * total * self.cache_dtype().itemsize

    def sampler(self, prompts: int) -> ProgramMemory:
        """Compiles the static sampler's prefill + decode program for ``prompts`` prompts."""
        c, mesh = self.config, self.sample_mesh
        request, _, _, gen_len = self._request(prompts)

        def rows(x):
            names = ("batch",) + (None,) * (x.ndim - 1)
            spec = logical_to_mesh(names, sh.SAMPLE_RULES, mesh, x.shape)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

        strategy = make_strategy(c.rollout.temperature, c.rollout.top_p, c.rollout.top_k)
        args = (
            self._sample_params(),
            self.rest,
            rows(request.prompt_ids),
            rows(request.prompt_mask),
            rows(request.max_new),
            rows(request.stop_ids),
            np.uint32(0),
            strategy,
        )
        fn = jax.jit(
            functools.partial(
                sampler_lib._program,
                graphdef=self.graphdef,
                n=c.rollout.samples_per_prompt,
                gen_len=gen_len,
                cache_dtype=self.cache_dtype(),
                return_hidden=False,
                pad_id=0,
                # The accelerator path: layer weights are read in place, no per-call copy.
                hoist_layers=False,
            )
        )
        return _compile(lambda: fn.lower(*args), mesh, sh.SAMPLE_RULES)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# Collective ops of an optimised HLO module and the result shape they produce per device.
_COLLECTIVE = re.compile(
    r"= (\(?[^=]*?\)?) (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
    r"(?:-start)?\("
)
_SHAPE = re.compile(r"(pred|[suf]\d+|bf16)\[([\d,]*)\]")


def _collective_bytes(hlo: str) -> int:
    """Bytes the collectives of a compiled (per-device) HLO module produce on one device."""
    total = 0
    for match in _COLLECTIVE.finditer(hlo):
        for dtype, dims in _SHAPE.findall(match.group(1)):
            bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype))
            total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def tpu_compiler_available() -> bool:
    """Whether the TPU compiler (``libtpu``, the ``tpu`` extra) can be loaded."""
    return importlib.util.find_spec("libtpu") is not None


def resolve_compiler(compiler: str) -> tuple[str, str]:
    """``("tpu" | "cpu", why)`` for ``--compiler auto | tpu | cpu``."""
    if compiler not in ("auto", "tpu", "cpu"):
        raise ValueError(f"--compiler={compiler!r}; expected 'auto', 'tpu' or 'cpu'")
    if compiler == "cpu":
        return "cpu", "--compiler cpu"
    if tpu_compiler_available():
        return "tpu", f"libtpu {importlib.metadata.version('libtpu')}"
    if compiler == "tpu":
        raise ValueError('--compiler tpu needs libtpu: pip install "delta-jax[tpu]"')
    return "cpu", 'libtpu not importable (pip install "delta-jax[tpu]" for TPU figures)'


def _chip_grid(chips: int, dims: int) -> tuple[int, ...]:
    """Physical chip grid of a slice (2D for v5e / v6e, 3D for v4 / v5p): near-square / cube."""
    if chips & (chips - 1):
        raise ValueError(f"{chips} chips: the planner knows power-of-two slices only")
    grid = [1] * dims
    while math.prod(grid) < chips:
        grid[grid.index(min(grid))] *= 2
    return tuple(grid)


def tpu_topology_devices(topology_name: str) -> tuple[str, list]:
    """Compile-only devices of a slice from the TPU compiler: ``(topology, devices)``.

    Example: ``v5p-64`` (32 chips) -> ``"v5p:2x4x4"``; ``v5e-8`` -> ``"v5e:2x4"``.
    """
    from jax.experimental import topologies

    # Compile-only use touches no chip: several processes (parallel plans, tests) may load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    chips = sh.topology(topology_name).chips
    gen = topology_name.strip().lower().split("-")[0].replace("v5litepod", "v5e")
    grid = _chip_grid(chips, 3 if gen in ("v4", "v5p") else 2)
    name = f"{gen}:{'x'.join(map(str, grid))}"
    kwargs = {}
    if chips < 4:  # the default host bounds (2x2x1) do not divide a smaller slice
        kwargs["chips_per_host_bounds"] = (*grid, 1, 1)[:3]
    desc = topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs)
    return name, list(desc.devices)


# The TPU compiler's refusals: "... required for HLO temporaries (334.10G) exceeds available
# HBM", or "CompileTimeHbmOom ... Program hbm requirement 9.08G".
_OOM = re.compile(
    r"RESOURCE_EXHAUSTED: (?:.*?HLO temporaries \(|[\s\S]*?Program hbm requirement )"
    r"([\d.]+)([KMGT])"
)


def _mesh(config, topology_name: str, compiler: str):
    """The run's mesh on the slice's devices for ``compiler``, and the compiler described."""
    kind, why = resolve_compiler(compiler)
    if kind == "tpu":
        grid, devices = tpu_topology_devices(topology_name)
        mesh = sh.make_mesh(*config.run.mesh, devices=devices)
        return mesh, f"TPU compiler, compile-only for {grid} ({why})"
    mesh = sh.mesh_from_config(config.run.mesh, topology_name=topology_name)
    return mesh, f"XLA:CPU on {mesh.size} stand-in devices, an estimate ({why})"


def compile_train_step(
    config, topology_name: str, *, compiler: str = "tpu", model_config=None, **model_changes
) -> ProgramMemory:
    """Memory of the run's train step alone (one micro-batch as configured) on the slice.

    ``model_changes`` override fields of the model config (``model_config``, default the run's),
    e.g. ``attention="dense"``.
    """
    mesh, _ = _mesh(config, topology_name, compiler)
    model_config = (model_config or resolve_model_config(config)).replace(**model_changes)
    c = config
    rows = c.rollout.prompts_per_step * c.rollout.samples_per_prompt // c.algo.mini_batches
    return _Planner(config, mesh, model_config).train(rows // c.algo.micro_batches)


def _compile(lower: Callable, mesh, rules) -> ProgramMemory:
    start = time.perf_counter()
    with sh.use_mesh(mesh, rules):
        lowered = lower()
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as err:
            match = _OOM.search(str(err))
            if match is None:
                raise
            scale = 1024 ** "KMGT".index(match.group(2)) * 1024
            need = int(float(match.group(1)) * scale)
            return ProgramMemory(0, 0, 0, need, time.perf_counter() - start, out_of_memory=True)
    return ProgramMemory.of(compiled, time.perf_counter() - start)


def largest_fitting(
    measure: Callable[[int], int],
    unit: int,
    budget: int,
    *,
    start: int,
    limit: int,
    max_measures: int = 8,
) -> int:
    """Largest multiple of ``unit`` in ``[unit, limit]`` with ``measure(x) <= budget`` (0: none).

    Peak memory grows about linearly with the batch, so a secant through measured sizes lands
    on (or next to) the answer; bisection takes over when the secant leaves the bracket. Each
    ``measure`` is a compilation, at most ``max_measures`` of them; the result is the largest
    size seen to fit.

    Args:
      measure: size -> bytes (non-decreasing in size).
      unit: sizes are multiples of it.
      budget: bytes available.
      start: a second size to measure besides ``unit`` (e.g. the configured one).
      limit: the largest size worth considering.
      max_measures: compilations allowed.

    Example:
      >>> largest_fitting(lambda x: 10 + 3 * x, 2, 40, start=4, limit=64)
      10
    """
    seen: dict[int, int] = {}

    def peak(x: int) -> int:
        if x not in seen:
            seen[x] = measure(x)
        return seen[x]

    def down(x: float) -> int:
        return max(unit, min(limit, int(x) // unit * unit))

    if peak(unit) > budget:
        return 0
    limit -= limit % unit
    if limit <= unit:
        return unit
    peak(down(max(2 * unit, start)))
    while len(seen) < max_measures:
        good = max(x for x in seen if seen[x] <= budget)
        bad = min((x for x in seen if seen[x] > budget), default=None)
        if good >= limit or (bad is not None and bad - good <= unit):
            break
        # Secant through the best fitting size and its nearest measured neighbour.
        other = (
            bad
            if bad is not None
            else max(x for x in seen if x < good)
            if any(x < good for x in seen)
            else None
        )
        slope = 0.0 if other is None else (seen[other] - seen[good]) / (other - good)
        guess = limit if slope <= 0 else down(good + (budget - seen[good]) / slope)
        upper = limit if bad is None else bad - unit
        if guess <= good:
            guess = good + unit
        if guess > upper or guess in seen:
            guess = down(good + (upper - good + unit) / 2)
            guess = guess if guess > good else good + unit
        peak(guess)
    return max(x for x in seen if seen[x] <= budget)


def plan(
    config,
    topology_name: str,
    *,
    model_config=None,
    headroom: float = 0.95,
    search: bool = True,
    compiler: str = "auto",
    compile_train: bool = True,
    log: Callable[[str], None] | None = None,
) -> PlanReport:
    """Compiles the run's train step and sampler for ``topology_name`` and reports memory.

    Args:
      config: the run :class:`~delta_jax.config.Config` (model, batch sizes, ``run.mesh``).
      topology_name: a TPU slice, e.g. ``"v5p-64"``, ``"v4-32"``, ``"v5e-8"``, ``"v6e-1"``. With
        the XLA:CPU estimate the process needs that many devices (fake CPU devices: see
        :func:`main`).
      model_config: overrides the model resolved from ``config.model.path``.
      headroom: fraction of HBM the programs may use.
      search: also search the largest fitting micro-batch and sampler call (more compiles).
      compiler: "tpu" (compile-only for the slice, needs libtpu), "cpu" (XLA:CPU estimate on
        stand-in devices) or "auto" (tpu when libtpu is importable).
      compile_train: False plans the sampler side only (train figures are then zero).
      log: progress messages (e.g. ``print``).

    Returns:
      A :class:`PlanReport`; ``report.table()`` formats it.
    """
    log = log or (lambda _: None)
    topo = sh.topology(topology_name)
    mesh, described = _mesh(config, topology_name, compiler)
    devices = list(mesh.devices.flat)
    log(f"compiler: {described}")
    model_config = model_config or resolve_model_config(config)
    planner = _Planner(config, mesh, model_config)
    c = config
    rows_per_update = (
        c.rollout.prompts_per_step * c.rollout.samples_per_prompt // c.algo.mini_batches
    )
    micro_rows = rows_per_update // c.algo.micro_batches
    divisor = sh.batch_divisor(mesh)
    if micro_rows % divisor:
        raise ValueError(
            f"micro-batch of {micro_rows} rows (rollout {rows_per_update} rows per update / "
            f"algo.micro_batches={c.algo.micro_batches}) does not split over the {divisor} batch "
            f"shards of mesh {dict(mesh.shape)}"
        )
    train = ProgramMemory(0, 0, 0, 0, 0.0)
    if compile_train:
        log(f"compiling train step ({micro_rows} rows per micro-batch) on {len(devices)} devices")
        train = planner.train(micro_rows)
        log(f"  train temporaries {train.temporaries / _GiB:.2f} GiB ({train.compile_s:.0f}s)")
    prompts = c.rollout.prompts_per_step
    measure_sampler = _engine_measure if c.rollout.engine == "continuous" else _static_measure
    size = c.rollout.decode_slots if c.rollout.engine == "continuous" else prompts
    sampled = measure_sampler(planner, size, log)
    log("compiling the reshard of the weights into the sampling layout")
    reshard, moved = planner.reshard()
    report = PlanReport(
        topology=topo.name,
        chips=len(devices),
        # v4's compile-only topology has one device per TensorCore (two per chip).
        hbm_bytes=topo.hbm_bytes * topo.chips // len(devices),
        headroom=headroom,
        compiler=described,
        mesh=dict(mesh.shape),
        sample_mesh=dict(planner.sample_mesh.shape),
        model=_describe(c.model.path, model_config),
        params_bytes=planner.params_bytes(),
        opt_state_bytes=planner.opt_state_bytes(),
        micro_batch_rows=micro_rows,
        train=train,
        engine=c.rollout.engine,
        sampler_prompts=prompts,
        samples_per_prompt=c.rollout.samples_per_prompt,
        sampler_params_bytes=planner.sampler_params_bytes(),
        shared_params_bytes=planner.shared_params_bytes(),
        reshard=reshard,
        reshard_collective_bytes=moved,
        max_micro_batch_rows=None,
        max_sampler_size=None,
        train_compiled=compile_train,
        **sampled,
    )
    if not search:
        return report
    budget = report.budget
    cache = {micro_rows: train.peak}

    def train_peak(rows: int) -> int:
        if rows not in cache:
            log(f"  train step with {rows} rows per micro-batch")
            cache[rows] = planner.train(rows).peak
        return cache[rows]

    resident = report.sampling_peak - report.sampler_peak
    sizes = {size: report.sampler_peak}

    def sampling_peak(n: int) -> int:
        if n not in sizes:
            got = measure_sampler(planner, n, log)
            sizes[n] = max(got["sampler"].peak, got["prefill"].peak if got["prefill"] else 0)
        return resident + sizes[n]

    max_rows = None
    if compile_train:
        max_rows = largest_fitting(
            train_peak, divisor, budget, start=micro_rows, limit=rows_per_update
        )
    sample_rows = sh.batch_divisor(planner.sample_mesh, sh.SAMPLE_RULES)
    if c.rollout.engine == "continuous":
        # Slots split over the sampling mesh's rows; a call never holds more sequences.
        limit = prompts * c.rollout.samples_per_prompt
        max_size = largest_fitting(
            sampling_peak, sample_rows, budget, start=size, limit=max(limit, sample_rows),
            max_measures=4,
        )  # fmt: skip
    else:
        # The sampler's rows (prompts x n) must split over the batch shards too.
        unit = sample_rows // math.gcd(sample_rows, c.rollout.samples_per_prompt)
        max_size = largest_fitting(
            sampling_peak, unit, budget, start=prompts, limit=max(prompts, unit)
        )
    return dataclasses.replace(report, max_micro_batch_rows=max_rows, max_sampler_size=max_size)


def _engine_measure(planner: _Planner, slots: int, log) -> dict[str, Any]:
    """The engine with ``slots`` decode slots: its pool and its two programs compiled."""
    spec = planner.engine_spec(slots)
    log(
        f"compiling the engine: {spec.slots} decode slots, {spec.num_pages} pages x "
        f"{spec.page_size} tokens, {spec.attention} attention"
    )
    decode, prefill = planner.engine(spec)
    log(
        f"  decode temporaries {decode.temporaries / _GiB:.2f} GiB, prefill "
        f"{prefill.temporaries / _GiB:.2f} GiB ({decode.compile_s + prefill.compile_s:.0f}s)"
    )
    return dict(
        cache_slots=spec.slots,
        num_pages=spec.num_pages,
        page_size=spec.page_size,
        kv_cache_bytes=planner.pool_bytes(spec),
        sampler=decode,
        prefill=prefill,
    )


def _static_measure(planner: _Planner, prompts: int, log) -> dict[str, Any]:
    """The static sampler's program for ``prompts`` prompts per call."""
    log(f"compiling the static sampler ({prompts} prompts)")
    sampler = planner.sampler(prompts)
    log(f"  sampler temporaries {sampler.temporaries / _GiB:.2f} GiB ({sampler.compile_s:.0f}s)")
    _, _, P, G = planner._request(prompts)
    return dict(
        cache_slots=P + G,
        num_pages=0,
        page_size=0,
        kv_cache_bytes=planner.kv_cache_bytes(prompts),
        sampler=sampler,
        prefill=None,
    )


def _describe(path: str, mc) -> str:
    return (
        f"{path} (L={mc.num_layers} H={mc.hidden_size} F={mc.intermediate_size} "
        f"N={mc.num_heads} K={mc.num_kv_heads} V={mc.vocab_size})"
    )


def _ensure_devices(count: int) -> None:
    """Makes this process start JAX on CPU with ``count`` fake devices, if JAX has not started."""
    if xla_bridge.backends_are_initialized():
        return
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of ``delta-jax plan`` (added to ``parser`` when given)."""
    parser = parser or argparse.ArgumentParser(
        prog="delta-jax plan", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", default=None, help="YAML run config")
    parser.add_argument("--topology", required=True, help="TPU slice, e.g. v5p-64, v4-32, v5e-8")
    parser.add_argument("--headroom", type=float, default=0.95, help="usable fraction of HBM")
    parser.add_argument(
        "--no-search", action="store_true", help="skip the micro-batch and decode-slot searches"
    )
    parser.add_argument(
        "--skip-train", action="store_true", help="plan the sampler side only (no train step)"
    )
    parser.add_argument(
        "--compiler",
        default="auto",
        choices=("auto", "tpu", "cpu"),
        help="tpu: the TPU compiler, compile-only (needs libtpu); cpu: XLA:CPU estimate; "
        "auto: tpu when libtpu is importable",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``delta-jax plan --config FILE --topology v5p-64 [section.key=value ...]``."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Runs the planner for parsed ``args`` (see :func:`build_parser`); prints the table."""
    from delta_jax.config import load_config

    if not 0 < args.headroom <= 1:
        raise ValueError(f"--headroom={args.headroom} must be in (0, 1]")
    kind, _ = resolve_compiler(args.compiler)
    # Compile-only TPU planning keeps the default backend on CPU (no TPU probing).
    _ensure_devices(sh.topology(args.topology).chips if kind == "cpu" else 1)
    config = load_config(args.config, args.overrides)
    report = plan(
        config,
        args.topology,
        headroom=args.headroom,
        search=not args.no_search,
        compiler=kind,
        compile_train=not args.skip_train,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
