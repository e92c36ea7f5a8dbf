"""``plan()``: compile the run's programs for a slice, report their memory, and search the largest
micro-batch and sampler size that fit."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from delta_jax import sharding as sh
from delta_jax.deprecation import fold_keywords
from delta_jax.plan import roofline as roofline_lib
from delta_jax.plan import schedules
from delta_jax.plan.buckets import compile_buckets
from delta_jax.plan.compiler import plan_mesh
from delta_jax.plan.models import describe, resolve_model_config
from delta_jax.plan.programs import Planner
from delta_jax.plan.report import GiB, PlanReport, ProgramMemory
from delta_jax.plan.roofline import Workload
from delta_jax.rl.packing import micro_batch_shape, uniform_rows
from delta_jax.sampling.attention import backend_for


def compile_train_step(
    config, topology_name: str, *, compiler: str = "tpu", model_config=None, **model_changes
) -> ProgramMemory:
    """Memory of the run's train step alone (one micro-batch as configured) on the slice.

    ``model_changes`` override fields of the model config (``model_config``, default the run's),
    e.g. ``attention="dense"``.
    """
    mesh, _ = plan_mesh(config, topology_name, compiler)
    model_config = (model_config or resolve_model_config(config)).replace(**model_changes)
    planner = Planner(config, mesh, model_config)
    plan = planner.update_plan
    _, rows = micro_batch_shape(plan, plan.rows_per_update, sh.batch_divisor(mesh))
    return planner.train(rows)


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

    ``measure`` may return None: the compiler refused that size for a memory no budget changes
    (SMEM, VMEM): it does not fit, and bisection, not the secant, looks below it.

    Peak memory grows about linearly with the batch, so a secant through measured sizes lands
    on (or next to) the answer; bisection takes over when the secant leaves the bracket. Each
    ``measure`` is a compilation, at most ``max_measures`` of them; the result is the largest
    size seen to fit.

    Args:
      measure: size -> bytes (non-decreasing in size), or None (refused).
      unit: sizes are multiples of it.
      budget: bytes available.
      start: a second size to measure besides ``unit`` (e.g. the configured one).
      limit: the largest size worth considering.
      max_measures: compilations allowed.

    Examples:
      >>> largest_fitting(lambda x: 10 + 3 * x, 2, 40, start=4, limit=64)
      10
    """
    seen: dict[int, int | None] = {}

    def peak(x: int) -> int | None:
        if x not in seen:
            seen[x] = measure(x)
        return seen[x]

    def fits(x: int) -> bool:
        return seen[x] is not None and seen[x] <= budget

    def down(x: float) -> int:
        return max(unit, min(limit, int(x) // unit * unit))

    peak(unit)
    if not fits(unit):
        return 0
    limit -= limit % unit
    if limit <= unit:
        return unit
    peak(down(max(2 * unit, start)))
    while len(seen) < max_measures:
        good = max(x for x in seen if fits(x))
        bad = min((x for x in seen if not fits(x)), default=None)
        if good >= limit or (bad is not None and bad - good <= unit):
            break
        # Secant through the best fitting size and its nearest measured neighbour (a refused
        # size has no figure: bisect towards it instead).
        other = (
            bad
            if bad is not None
            else max(x for x in seen if x < good)
            if any(x < good for x in seen)
            else None
        )
        if other is not None and seen[other] is None:
            guess = down(good + (other - good) / 2)
        else:
            slope = 0.0 if other is None else (seen[other] - seen[good]) / (other - good)
            guess = limit if slope <= 0 else down(good + (budget - seen[good]) / slope)
        upper = limit if bad is None else bad - unit
        if guess <= good:
            guess = good + unit
        if guess > upper or guess in seen:
            guess = down(good + (upper - good + unit) / 2)
            guess = guess if guess > good else good + unit
        peak(guess)
    return max(x for x in seen if fits(x))


def _bound(found: int, measured: dict[int, ProgramMemory | None], budget: int, unit: str) -> str:
    """The smallest measured size above ``found`` that does not fit, and why."""
    over = sorted(x for x, m in measured.items() if x > found and m is not None)
    if not over:
        return ""
    x, m = over[0], measured[over[0]]
    if not m.fits_anywhere:
        return f"{x} {unit}: {m.refusal()}"
    at_least = ">= " if m.out_of_memory else ""  # HBM refused: the need it states, a lower bound
    return f"{x} {unit}: {at_least}{m.peak / GiB:.2f} GiB > budget {budget / GiB:.2f} GiB"


def _micro_rows(c, plan, mesh, workload: Workload) -> int:
    """Rows per micro-batch, the run's shapes and ``workload`` checked."""
    rows_per_update, divisor = plan.rows_per_update, sh.batch_divisor(mesh)
    micro_rows = micro_batch_shape(plan, rows_per_update, divisor)[1]
    if micro_rows % divisor:
        raise ValueError(
            f"micro-batch of {micro_rows} rows (rollout {rows_per_update} rows per update / "
            f"algo.micro_batches={c.algo.micro_batches}) does not split over the {divisor} batch "
            f"shards of mesh {dict(mesh.shape)}"
        )
    if c.rollout.max_turns > 1 and c.rollout.engine != "continuous":
        raise ValueError(
            f"rollout.max_turns={c.rollout.max_turns} (multi-turn) needs rollout.engine=continuous"
        )
    workload.mean_new(c.rollout)
    return micro_rows


def plan(
    config,
    topology_name: str,
    *,
    model_config=None,
    headroom: float = 0.95,
    search: bool = True,
    compiler: str = "auto",
    compile_train: bool = True,
    roofline: bool | Workload = False,
    programs: bool = False,
    log: Callable[[str], None] | None = None,
    **deprecated,
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
      roofline: also bound the RL step's time (:mod:`.roofline`; two more train compiles, of 1
        and 2 unrolled layers, also with ``compile_train`` False); continuous engine only. A
        :class:`~delta_jax.plan.roofline.Workload` sets what it assumes of the sequences (True:
        ``Workload()``, the longest responses): its ``mean_new_tokens`` (checked here), and
        its ``tokens_per_step``, a measured tokens per speculative verify step: the roofline
        also bounds the rollout with speculation (``rollout.draft_tokens`` drafts a step; one
        more compile, the verify chunk), beside the bound without.
      programs: also compile every program a run compiles (:mod:`.buckets`: the train step
        at each bucket of rows, the engine's decode chunk at each slot bucket and prefill chunk
        at each length) and list their compile times; continuous engine only.
      log: progress messages (e.g. ``print``).
      deprecated: ``mean_new_tokens`` and ``tokens_per_step`` as keywords, the previous
        release's form of ``roofline=Workload(...)`` (a DeprecationWarning).

    Returns:
      A :class:`PlanReport`; ``report.table()`` formats it.
    """
    workload = roofline if isinstance(roofline, Workload) else Workload()
    workload = fold_keywords("plan", workload, deprecated, "roofline=Workload(...)")
    log = log or (lambda _: None)
    topo = sh.topology(topology_name)
    mesh, described = plan_mesh(config, topology_name, compiler)
    devices = list(mesh.devices.flat)
    log(f"compiler: {described}")
    model_config = model_config or resolve_model_config(config, log)
    planner = Planner(config, mesh, model_config)
    c = config
    micro_rows = _micro_rows(c, planner.update_plan, mesh, workload)
    train = ProgramMemory(0, 0, 0, 0, 0.0)
    if compile_train:
        log(f"compiling train step ({micro_rows} rows per micro-batch) on {len(devices)} devices")
        train = planner.train(micro_rows)
        log(f"  train temporaries {train.temporaries / GiB:.2f} GiB ({train.compile_s:.0f}s)")
    size = _sampler_size(c)
    sampled = _sampler_measure(c)(planner, size, log)
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
        model=describe(c.model.path, model_config),
        params_bytes=planner.params_bytes(),
        opt_state_bytes=planner.opt_state_bytes(),
        micro_batch_rows=micro_rows,
        train=train,
        engine=c.rollout.engine,
        sampler_prompts=c.rollout.prompts_per_step,
        samples_per_prompt=c.rollout.samples_per_prompt,
        max_turns=c.rollout.max_turns,
        sampler_params_bytes=planner.sampler_params_bytes(),
        shared_params_bytes=planner.shared_params_bytes(),
        reshard=reshard,
        reshard_collective_bytes=moved,
        max_micro_batch_rows=None,
        max_sampler_size=None,
        train_compiled=compile_train,
        **sampled,
    )
    if roofline and c.rollout.engine == "continuous":
        step_time = _step_time(planner, report, size, workload, log)
        report = dataclasses.replace(report, roofline=step_time)
    if programs and c.rollout.engine == "continuous":
        trains = {micro_rows: train} if compile_train else {}
        built = compile_buckets(planner, planner.engine_spec(size), trains, log)
        report = dataclasses.replace(report, programs=tuple(built))
    return _search(planner, report, size, log) if search else report


def _sampler_size(c) -> int:
    """The sampler's configured size: decode slots (continuous engine) or prompts per call."""
    if c.rollout.engine == "continuous":
        return c.rollout.decode_slots
    return c.rollout.prompts_per_step


def _sampler_measure(c) -> Callable[[Planner, int, Callable[[str], None]], dict[str, Any]]:
    """The rollout's sampler compiled at a size: the engine's or the static sampler's."""
    return _engine_measure if c.rollout.engine == "continuous" else _static_measure


def _search(planner: Planner, report: PlanReport, size: int, log) -> PlanReport:
    """The largest micro-batch and sampler call that fit the budget (more compiles), and what
    bounds each, from the ``report`` of the configured sizes (``size``: the sampler's)."""
    c, micro_rows, prompts = planner.config, report.micro_batch_rows, report.sampler_prompts
    budget, compile_train = report.budget, report.train_compiled
    measure_sampler = _sampler_measure(c)
    # Every size measured: its program (a train step; the sampler's larger one, a refused one
    # first), for the peaks and the bound reported.
    trains = {micro_rows: report.train}

    def train_peak(rows: int) -> int | None:
        if rows not in trains:
            log(f"  train step with {rows} rows per micro-batch")
            trains[rows] = planner.train(rows)
            if trains[rows].out_of_memory:
                log(f"  {trains[rows].refusal()}")
        return trains[rows].measured_peak()

    resident = report.sampling_peak - report.sampler_peak
    sizes = {size: _sampler_program(report.sampler, report.prefill)}

    def sampling_peak(n: int) -> int | None:
        if n not in sizes:
            measured = measure_sampler(planner, n, log)
            sizes[n] = _sampler_program(measured["sampler"], measured["prefill"])
            if sizes[n].out_of_memory:
                log(f"  {sizes[n].refusal()}")
        peak = sizes[n].measured_peak()
        return None if peak is None else resident + peak

    def sampling_memory(n: int) -> ProgramMemory:  # as the report counts it: + resident state
        m = sizes[n]
        return dataclasses.replace(m, temporaries=m.temporaries + resident) if m.peak else m

    max_rows = None
    if compile_train:
        divisor = sh.batch_divisor(planner.mesh)
        limit = planner.update_plan.rows_per_update
        max_rows = largest_fitting(train_peak, divisor, budget, start=micro_rows, limit=limit)
    sample_rows = sh.batch_divisor(planner.sample_mesh, sh.SAMPLE_RULES)
    if c.rollout.engine == "continuous":
        # Slots split over the sampling mesh's rows; a call never holds more sequences.
        limit = max(prompts * c.rollout.samples_per_prompt, sample_rows)
        max_size = largest_fitting(
            sampling_peak, sample_rows, budget, start=size, limit=limit, max_measures=4
        )
    else:
        # The sampler's rows (prompts x n) must split over the batch shards too.
        unit = sample_rows // math.gcd(sample_rows, c.rollout.samples_per_prompt)
        max_size = largest_fitting(
            sampling_peak, unit, budget, start=prompts, limit=max(prompts, unit)
        )
    slot_unit = "slots" if c.rollout.engine == "continuous" else "prompts"
    return dataclasses.replace(
        report,
        max_micro_batch_rows=max_rows,
        max_sampler_size=max_size,
        micro_batch_bound=_bound(max_rows or 0, trains, budget, "rows") if compile_train else "",
        sampler_bound=_bound(max_size, {n: sampling_memory(n) for n in sizes}, budget, slot_unit),
    )


def _step_time(planner: Planner, report: PlanReport, slots: int, workload: Workload, log):
    """The step-time roofline (:mod:`.roofline`) from the programs the plan compiled, at the
    ``workload`` (and the speculative verify chunk's, when it gives tokens per verify step)."""
    c, mc = planner.config, planner.model_config
    mean_new = workload.mean_new(c.rollout)
    spec = planner.engine_spec(slots)
    speculation = None
    if workload.tokens_per_step is not None:
        speculation = _speculation(planner, slots, workload.tokens_per_step, log)
    layers = {}
    for k in (1, 2):
        log(f"compiling the train step with {k} unrolled layer(s) for its cost analysis")
        shallow = Planner(c, planner.mesh, mc.replace(num_layers=k, scan_layers=False))
        layers[k] = shallow.train(report.micro_batch_rows)
    _, _, prompt_len, _ = planner.request(c.rollout.prompts_per_step)
    chunk = min(spec.prefill_len, max(spec.min_len, 1 << max(0, (prompt_len - 1).bit_length())))
    programs = roofline_lib.Programs(
        decode=report.sampler,
        prefill=report.prefill,
        prefill_tokens=spec.prefill_rows // spec.groups * chunk,
        train_one=layers[1],
        train_two=layers[2],
    )
    chips = sh.topology(report.topology).chips
    tpu = roofline_lib.Slice(report.topology, chips=chips, devices=report.chips)
    update = _update_shape(planner, report.micro_batch_rows, mean_new)
    rollout = _rollout_shape(planner, spec, mean_new)
    step_time = roofline_lib.estimate(mc, tpu, programs, update, rollout, c.run.steps, speculation)
    if workload.lengths is None:
        return step_time
    engine = schedules.Engine(
        groups=spec.groups,
        chips=chips,
        sequences=rollout.sequences_per_group,
        slots=rollout.group_slots,
        prompts=rollout.prompts_per_group,
        prompt_len=rollout.prompt_len,
        decode_step_s=step_time.decode_s / max(step_time.decode_steps, 1),
        prefill_token_s=step_time.prefill_s / (rollout.prompts_per_group * rollout.prompt_len),
    )
    sampled = schedules.sample_steps(workload.lengths, engine)
    at_lengths = schedules.bounds(
        workload.lengths, sampled, engine, step_time.update_s, workload.max_staleness
    )
    return dataclasses.replace(step_time, lengths=at_lengths)


def _speculation(planner: Planner, slots: int, tokens_per_step: float, log):
    """The speculative decode chunk compiled (``rollout.draft_tokens`` drafts, a trie up to
    ``rollout.draft_depth`` deep), at ``tokens_per_step`` tokens per verify step."""
    k, depth = planner.config.rollout.draft_tokens, planner.config.rollout.draft_depth
    trie = f", a trie up to {depth} deep" if depth else ""
    log(f"compiling the speculative decode chunk ({k} drafted tokens per verify step{trie})")
    verify_spec = planner.engine_spec(slots, draft_tokens=k, draft_depth=depth)
    return roofline_lib.Speculation(
        verify=planner.decode(verify_spec),
        tokens_per_step=tokens_per_step,
        draft_tokens=k,
        draft_depth=depth,
        verify_attention=verify_spec.attention,
    )


def _update_shape(planner: Planner, micro_rows: int, mean_new: float) -> roofline_lib.Update:
    """The update's rows at ``mean_new`` new tokens, as the trainer lays them out (packed,
    prompts shared)."""
    c, plan, shards = planner.config, planner.update_plan, sh.batch_divisor(planner.mesh)
    rows = uniform_rows(plan, c.data.max_prompt_length, max(1, round(mean_new)), shards)
    return roofline_lib.Update(
        micro_batches=micro_batch_shape(plan, plan.rows_per_update, shards)[0],
        micro_rows=micro_rows,
        mini_batches=c.algo.mini_batches,
        useful_tokens=rows["batch/positions"] / rows["batch/packed_rows"] / plan.mini_batches,
        rows=rows["batch/packed_rows"],
        shared_prompts=bool(rows["batch/shared_prompts"]),
    )


def _rollout_shape(planner: Planner, spec, mean_new: float) -> roofline_lib.Rollout:
    """The rollout per data group of the engine ``spec``, at ``mean_new`` new tokens."""
    c, mc, G = planner.config, planner.model_config, spec.groups
    tensor = planner.sample_mesh.shape.get("tensor", 1)
    return roofline_lib.Rollout(
        sequences_per_group=c.rollout.prompts_per_step * c.rollout.samples_per_prompt // G,
        group_slots=spec.group_slots,
        prompts_per_group=c.rollout.prompts_per_step // G,
        prompt_len=c.data.max_prompt_length,
        mean_new=mean_new,
        kv_heads=max(1, mc.num_kv_heads // tensor),
        cache_itemsize=planner.cache_dtype().itemsize,
        weight_bytes=planner.sampler_params_bytes() + planner.shared_params_bytes(),
    )


def _sampler_program(sampler: ProgramMemory, prefill: ProgramMemory | None) -> ProgramMemory:
    """The engine's larger program (decode or prefill chunk), a refused one first."""
    programs = [sampler, *([prefill] if prefill else [])]
    refused = [p for p in programs if not p.fits_anywhere]
    return refused[0] if refused else max(programs, key=lambda p: p.peak)


def _engine_measure(planner: Planner, slots: int, log) -> dict[str, Any]:
    """The engine with ``slots`` decode slots: its pool and its two programs compiled."""
    spec = planner.engine_spec(slots)
    waiting = planner.waiting_pages(slots)
    pool = dict(
        cache_slots=spec.slots,
        num_pages=spec.num_pages,
        page_size=spec.page_size,
        kv_cache_bytes=planner.pool_bytes(spec),
        waiting_pages=waiting,
        waiting_bytes=planner.pool_bytes(spec, waiting),
        data_groups=spec.groups,
    )
    if refusal := backend_for(spec.attention).refusal(spec):
        # The engine refuses this before compiling (the TPU kernel's page table in SMEM).
        log(f"  {refusal}")
        refused = ProgramMemory(0, 0, 0, 0, 0.0, out_of_memory=True, refused="SMEM")
        return dict(pool, sampler=refused, prefill=refused)
    log(
        f"compiling the engine: {spec.groups} data groups x ({spec.group_slots} decode slots, "
        f"{spec.group_pages} pages of {spec.page_size} tokens), {spec.attention} attention"
    )
    decode, prefill = planner.engine(spec)
    log(
        f"  decode temporaries {decode.temporaries / GiB:.2f} GiB, prefill "
        f"{prefill.temporaries / GiB:.2f} GiB ({decode.compile_s + prefill.compile_s:.0f}s)"
    )
    return dict(pool, sampler=decode, prefill=prefill)


def _static_measure(planner: Planner, prompts: int, log) -> dict[str, Any]:
    """The static sampler's program for ``prompts`` prompts per call."""
    log(f"compiling the static sampler ({prompts} prompts)")
    sampler = planner.sampler(prompts)
    log(f"  sampler temporaries {sampler.temporaries / GiB:.2f} GiB ({sampler.compile_s:.0f}s)")
    _, _, P, G = planner.request(prompts)
    return dict(
        cache_slots=P + G,
        num_pages=0,
        page_size=0,
        kv_cache_bytes=planner.kv_cache_bytes(prompts),
        sampler=sampler,
        prefill=None,
    )
