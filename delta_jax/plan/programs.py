"""The run's programs built abstractly (no weights) and compiled for one mesh: the train step, the
per-update reshard into the sampling layout, and the rollout's sampler (continuous engine or
static)."""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from delta_jax import sharding as sh
from delta_jax.models import Transformer, lora
from delta_jax.models.axes import logical_to_mesh
from delta_jax.models.transformer import KEY_CACHE_AXES, VALUE_CACHE_AXES
from delta_jax.plan.compiler import collective_bytes, compile_program
from delta_jax.plan.lowering import lower_decode, lower_prefill
from delta_jax.plan.report import ProgramMemory
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.rl.train_step import abstract_batch, make_train_step
from delta_jax.rl.update_plan import UpdatePlan
from delta_jax.sampling.attention import pages_for, pow2, resolve_attention
from delta_jax.sampling.attention.paged import PAGE_AXES
from delta_jax.sampling.buckets import Buckets, prepare_request
from delta_jax.sampling.engine import EngineSettings, RequestShape, size_engine
from delta_jax.sampling.speculation import Drafter
from delta_jax.sampling.static import StaticOptions, static_program
from delta_jax.sampling.strategies import make_strategy


def _sharded_bytes(tree: Any, shardings: Any) -> int:
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        total += math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
    return total


class Planner:
    """Builds and compiles the run's programs for one mesh; caches nothing but the setup.

    ``sample_mesh``: the devices the rollout runs on when they are not the trainer's
    (asynchronous rollouts, ``rollout.async_devices``); default ``mesh``'s.
    """

    def __init__(self, config, mesh, model_config, sample_mesh=None):
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
        # The rollout's layout (rl.trainer): tensor-parallel regrouping, compute-dtype weights.
        self.sample_mesh = sh.sampling_mesh(sample_mesh or mesh, model_config.num_kv_heads)
        self.apart = set(self.sample_mesh.devices.flat).isdisjoint(mesh.devices.flat)
        self.sample_shardings = sh.param_shardings(self.params, self.sample_mesh, sh.SAMPLE_RULES)
        self.sample_dtypes = [
            sh.sampling_dtype(x.dtype, dtype) for x in jax.tree.leaves(self.params)
        ]
        self.update_plan = UpdatePlan.from_config(config, mesh.devices.flat[0].platform)

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
        weight update's reshard, from the compiled program's collectives). On the sampler's own
        devices the weights are copied over first (a transfer, no program) and cast there.
        """
        moved = self._moved()
        if not moved:
            return ProgramMemory(0, 0, 0, 0, 0.0), 0
        leaves = jax.tree.leaves(self.params)
        sources, targets = (
            jax.tree.leaves(self.param_shardings),
            jax.tree.leaves(self.sample_shardings),
        )
        placed = targets if self.apart else sources
        args = [
            jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype, sharding=placed[i])
            for i in moved
        ]
        program = sh.resharder(
            tuple(targets[i] for i in moved), tuple(self.sample_dtypes[i] for i in moved)
        )
        start = time.perf_counter()
        compiled = program.lower(*args).compile()
        return ProgramMemory.of(compiled, time.perf_counter() - start), collective_bytes(
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
        return compile_program(lambda: step.lower(self.state, batch), self.mesh, sh.TRAIN_RULES)

    def request(self, prompts: int):
        """The rollout's request for ``prompts`` prompts as the trainer builds it: the request
        arrays, its rows, prompt bucket and generation bucket."""
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

    def engine_spec(self, slots: int, draft_tokens: int = 0, draft_depth: int = 0):
        """The engine's static configuration for the run's request, as the rollout builds it
        (multi-turn when ``rollout.max_turns`` > 1: the default pool also holds the pages of
        every sequence waiting on the host; speculative with ``draft_tokens``, a trie of them
        with ``draft_depth``)."""
        r = self.config.rollout
        return self._engine_spec(
            slots, r.max_turns > 1, r.num_pages or None, draft_tokens, draft_depth
        )

    def waiting_pages(self, slots: int) -> int:
        """Pages (every group's) that sequences waiting on the host hold with no decode slot:
        what the engine's default multi-turn pool adds to its single-turn one; 0 single-turn."""
        if self.config.rollout.max_turns == 1:
            return 0
        multi, single = (self._engine_spec(slots, turns, None) for turns in (True, False))
        return multi.num_pages - single.num_pages

    def _engine_spec(
        self,
        slots: int,
        multi_turn: bool,
        num_pages: int | None,
        draft_tokens: int = 0,
        draft_depth: int = 0,
    ):
        c, mc = self.config, self.model_config
        platform = self.sample_mesh.devices.flat[0].platform
        settings = EngineSettings(
            attention=resolve_attention("auto", platform, mc.head_dim),
            groups=sh.batch_divisor(self.sample_mesh, sh.SAMPLE_RULES),
            decode_slots=slots,
            page_size=c.rollout.page_size,
            num_pages=num_pages,
        )
        request, *_ = self.request(c.rollout.prompts_per_step)
        # The window the sampler's drafter gives a chunk (its defaults: the trainer's).
        drafter = Drafter(draft_depth or draft_tokens) if draft_tokens else None
        return size_engine(
            settings,
            RequestShape.of(request, c.rollout.samples_per_prompt),
            return_hidden=False,
            multi_turn=multi_turn,
            draft_tokens=draft_tokens,
            draft_depth=draft_depth,
            draft_window=drafter.window_size(settings.decode_chunk) if drafter else 0,
        )

    def pool_bytes(self, spec, pages: int | None = None) -> int:
        """Per-device bytes of the engine's page pool, or of ``pages`` of its pages (every
        group's) (``PAGE_AXES`` on the sampling mesh: a data group's share of the pages, split
        by KV heads over its chips)."""
        mc = self.model_config
        pages = spec.num_pages if pages is None else pages
        shape = (pages, spec.page_size, 2 * mc.num_kv_heads, mc.head_dim)
        pool = logical_to_mesh(PAGE_AXES, sh.SAMPLE_RULES, self.sample_mesh, shape)
        per_layer = math.prod(NamedSharding(self.sample_mesh, pool).shard_shape(shape))
        return mc.num_layers * per_layer * self.cache_dtype().itemsize

    def engine(self, spec) -> tuple[ProgramMemory, ProgramMemory]:
        """Compiles the engine's decode chunk and its largest prefill chunk for ``spec``."""
        return self.decode(spec), compile_program(
            lambda: self._lower_prefill(spec), self.sample_mesh, sh.SAMPLE_RULES
        )

    def decode(self, spec, rows: int | None = None) -> ProgramMemory:
        """Compiles the engine's decode chunk for ``spec`` (its verify steps with
        ``spec.draft_tokens``) over ``rows`` slots (every group's; default all of them)."""
        mc, compute = self.model_config, jnp.dtype(self.config.model.dtype)
        return compile_program(
            lambda: lower_decode(
                mc,
                self.sample_mesh,
                sh.SAMPLE_RULES,
                spec,
                slots=rows,
                dtype=compute,
                cache_dtype=self.cache_dtype(),
            ),
            self.sample_mesh,
            sh.SAMPLE_RULES,
        )

    def prefill(self, spec, length: int) -> ProgramMemory:
        """Compiles the engine's prefill chunk of ``length`` tokens per row for ``spec``."""
        lower = lambda: self._lower_prefill(spec, length)
        return compile_program(lower, self.sample_mesh, sh.SAMPLE_RULES)

    def _lower_prefill(self, spec, length: int | None = None):
        """The engine's prefill program of ``length`` tokens per row (default its largest: the
        last chunk of the longest prompts)."""
        _, _, prompt_len, _ = self.request(self.config.rollout.prompts_per_step)
        rows = spec.prefill_rows
        T = length or min(spec.prefill_len, max(spec.min_len, pow2(prompt_len)))
        per_group = rows // spec.groups
        return lower_prefill(
            self.model_config,
            self.sample_mesh,
            sh.SAMPLE_RULES,
            spec,
            length=T,
            list_pages=pow2(per_group * pages_for(-(-prompt_len // T) * T, spec.page_size)),
            cache_dtype=self.cache_dtype(),
            model=(self.graphdef, self._sample_params(), self.rest),
        )

    # ---- the static sampler (rollout.engine: static) ------------------------------------------

    def kv_cache_bytes(self, prompts: int) -> int:
        """Per-device bytes of the static sampler's cache, in the model's layout (one K and one
        V buffer per layer, ``KEY_CACHE_AXES`` / ``VALUE_CACHE_AXES``)."""
        mc, mesh = self.model_config, self.sample_mesh
        _, rows, P, G = self.request(prompts)
        B, K, D, S = rows, mc.num_kv_heads, mc.head_dim, P + G
        total = 0
        for names, shape in ((KEY_CACHE_AXES, (B, K, D, S)), (VALUE_CACHE_AXES, (B, K, S, D))):
            spec = logical_to_mesh(names, sh.SAMPLE_RULES, mesh, shape)
            total += math.prod(NamedSharding(mesh, spec).shard_shape(shape))
        return mc.num_layers * total * self.cache_dtype().itemsize

    def sampler(self, prompts: int) -> ProgramMemory:
        """Compiles the static sampler's prefill + decode program for ``prompts`` prompts."""
        c, mesh = self.config, self.sample_mesh
        request, _, _, gen_len = self.request(prompts)

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
        options = StaticOptions(
            graphdef=self.graphdef,
            n=c.rollout.samples_per_prompt,
            gen_len=gen_len,
            cache_dtype=self.cache_dtype(),
            return_hidden=False,
            pad_id=0,
            # The accelerator path: layer weights are read in place, no per-call copy.
            hoist_layers=False,
        )
        fn = jax.jit(functools.partial(static_program, options=options))
        return compile_program(lambda: fn.lower(*args), mesh, sh.SAMPLE_RULES)
