"""What a plan found: per-device bytes of each compiled program, and the report's table."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from delta_jax.plan.hlo import COMPUTATION_HEAD, Cost, loop_cost

GiB = 1024**3
_EXACT = "exact (shapes x shardings)"  # the source of the figures that shapes and shardings give

# A splash-attention kernel call in an optimised HLO module (JAX names the custom calls after the
# kernel: splash_mha_fwd..., splash_mha_dq..., splash_mha_dkv...) and the shapes it produces: the
# forward's are its scratch buffers, its output [rows, heads, T, D] ([heads, T, D] when a device
# holds one row) and, with residuals, the log-sum-exp last.
_SPLASH = re.compile(r"%splash_mha_(fwd|dq|dkv)([\w.]*) = \(?(.*?)\)? custom-call\(")
_SHAPE = re.compile(r"(bf16|f16|f32)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class SplashCalls:
    """The splash-attention kernel calls of one compiled program (per device): how many forward,
    dq and dkv kernels it runs (a rematerialised forward counts twice), and the forward's output
    ``[rows, heads, length, head_dim]`` (padded length) and its bytes per element."""

    fwd: int
    dq: int
    dkv: int
    shape: tuple[int, int, int, int]
    itemsize: int

    @classmethod
    def of(cls, hlo: str, runs: dict[str, int] | None = None) -> SplashCalls | None:
        """The calls in ``hlo``, each as many times as its computation runs (``runs``, from
        :func:`.hlo.loop_cost`: a call in a loop body counts its trip count)."""
        calls = {"fwd": 0, "dq": 0, "dkv": 0}
        shape, computation = None, ""
        for line in hlo.splitlines():
            head = COMPUTATION_HEAD.match(line)
            computation = head.group(2) if head else computation
            found = _SPLASH.search(line)
            if not found:
                continue
            kind, name, outputs = found.groups()
            calls[kind] += (runs or {}).get(computation, 1)
            if kind == "fwd" and shape is None:
                dtype, dims = _SHAPE.findall(outputs)[-1 if "no_residuals" in name else -2]
                dims = tuple(int(d) for d in dims.split(","))
                shape = (dtype, dims if len(dims) == 4 else (1, *dims))
        if shape is None:
            return None
        dtype, dims = shape
        return cls(**calls, shape=dims, itemsize=2 if dtype in ("bf16", "f16") else 4)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program (XLA buffer assignment), and its cost analysis.

    ``out_of_memory``: the TPU compiler refused the program for lack of memory; ``refused`` says
    which (``"HBM"``, ``"SMEM"``, ``"VMEM"``). For HBM ``temporaries`` is the requirement its
    error message states and the other fields are 0, so ``peak`` is a lower bound; for an
    on-core memory (SMEM, VMEM) no HBM figure exists and the program does not fit at any budget.

    ``flops`` / ``bytes_accessed``: XLA's cost analysis per device, every loop body times its
    trip count (:func:`.hlo.loop_cost`; ``loops_counted_once``: loops whose trip count was not
    found, counted once). ``splash``: the splash-attention kernel calls the program makes
    (:class:`SplashCalls`), whose inside the cost analysis does not see.
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    compile_s: float
    out_of_memory: bool = False
    refused: str = ""
    flops: float = 0.0
    bytes_accessed: float = 0.0
    splash: SplashCalls | None = None
    loops_counted_once: int = 0

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def fits_anywhere(self) -> bool:
        """False when refused for an on-core memory (or an HBM refusal stating no figure)."""
        return not self.out_of_memory or (self.refused == "HBM" and self.temporaries > 0)

    def measured_peak(self) -> int | None:
        """The peak for a search: None when no HBM budget makes the program fit."""
        return self.peak if self.fits_anywhere else None

    def refusal(self) -> str:
        if not self.out_of_memory:
            return ""
        if self.refused == "HBM":
            return "TPU compiler: out of memory, a lower bound"
        return f"TPU compiler: refused, out of {self.refused or 'memory'}"

    @classmethod
    def of(cls, compiled, compile_s: float) -> ProgramMemory:
        stats = compiled.memory_analysis()
        text = compiled.as_text()
        try:
            cost = loop_cost(text)
        except (ImportError, AttributeError):  # jaxlib without its HLO text parser
            once = compiled.cost_analysis() or {}
            once = once[0] if isinstance(once, list | tuple) else once
            loops = text.count(" while(")
            cost = Cost(once.get("flops", 0.0), once.get("bytes accessed", 0.0), {}, loops, loops)
        return cls(
            arguments=int(stats.argument_size_in_bytes),
            outputs=int(stats.output_size_in_bytes),
            aliased=int(stats.alias_size_in_bytes),
            temporaries=int(stats.temp_size_in_bytes),
            compile_s=compile_s,
            flops=cost.flops,
            bytes_accessed=cost.bytes_accessed,
            splash=SplashCalls.of(text, cost.runs),
            loops_counted_once=cost.unknown_trips,
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
    cache_slots: int  # static: cache length; engine: decode slots (every data group's)
    num_pages: int  # engine: pages in the pool (every group's, scratch pages included); static: 0
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
    data_groups: int = 1  # engine: sampling-mesh row shards, each with its slots and pages
    max_turns: int = 1  # rollout.max_turns: > 1, sequences keep their pages while tools run
    # Multi-turn engine: pages (every group's) and bytes (per device) that sequences waiting on
    # the host hold with no decode slot, in the default pool on top of the single-turn one.
    waiting_pages: int = 0
    waiting_bytes: int = 0
    # The searches' bound: the smallest size measured not to fit, and why ("" when none was).
    micro_batch_bound: str = ""
    sampler_bound: str = ""
    roofline: Any = None  # a roofline.StepTime when the plan computed one
    # --programs: every program a run compiles, (name, memory and compile time) each.
    programs: tuple[tuple[str, ProgramMemory], ...] = ()

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
        programs = [self.sampler, *([self.prefill] if self.prefill else [])]
        programs += [self.train] if self.train_compiled else []
        fit_somewhere = all(p.fits_anywhere for p in programs)
        return fit_somewhere and max(self.train_peak, self.sampling_peak) <= self.budget

    @property
    def headroom_bytes(self) -> int:
        """Budget left at the larger of the two peaks (negative: does not fit)."""
        return self.budget - max(self.train_peak, self.sampling_peak)

    def table(self) -> str:
        """The report as an aligned text table (GiB per device, and where each figure is from)."""
        mesh = lambda m: " x ".join(f"{k}={v}" for k, v in m.items())
        comp = self.compiler_name
        train_src, train_share = "not compiled (--skip-train)", "not compiled"
        if self.train_compiled:
            train_src = self._source(self.train)
            train_share = f"{self.train_peak / self.budget:.0%}"
        lines = [
            f"{self.model} on {self.topology} ({self.chips} devices, {self.hbm_bytes / GiB:.0f} "
            f"GiB HBM each; budget {self.headroom:.0%} = {self.budget / GiB:.1f} GiB); train "
            f"mesh {mesh(self.mesh)}, sampling mesh {mesh(self.sample_mesh)}",
            f"compiler: {self.compiler}",
            f"{'per device':<40}{'GiB':>8}  source",
            _row("parameters (train placement)", self.params_bytes, _EXACT),
            _row("optimizer state", self.opt_state_bytes, _EXACT),
            f"train step, micro-batch {self.micro_batch_rows} rows:",
            _row("  train temporaries", self.train.temporaries, train_src),
            _row("  peak (state + batch + temporaries)", self.train_peak, train_src),
            *self._sampler_lines(),
            _row("headroom (budget - larger peak)", self.headroom_bytes, comp),
            f"fits: {'YES' if self.fits else 'NO'} (train {train_share}, sampling "
            f"{self.sampling_peak / self.budget:.0%} of budget)",
            f"weights to the sampling layout, per update: {_gib(self.reshard_collective_bytes)} "
            f"GiB through collectives, {_gib(self.reshard.temporaries)} GiB temporaries ({comp})",
            "largest micro-batch that fits: "
            f"{_rows(self.max_micro_batch_rows, 'rows', self.micro_batch_bound)}",
            self._largest_sampler_line(),
            *(self.roofline.lines() if self.roofline is not None else []),
            *self._program_lines(),
            f"compile time: train {self.train.compile_s:.1f}s, sampler "
            f"{self.sampler.compile_s + (self.prefill.compile_s if self.prefill else 0):.1f}s "
            f"({comp})",
        ]
        return "\n".join(lines)

    def _source(self, program: ProgramMemory) -> str:
        """Where a compiled program's figures come from (and the compiler's refusal, if any)."""
        refused = f" ({program.refusal()})" if program.out_of_memory else ""
        return self.compiler_name + refused

    def _sampler_lines(self) -> list[str]:
        """The table's sampler section: its head, cache, weights, temporaries and peak."""
        sampler_src = self._source(self.sampler)
        if self.engine == "continuous":
            G = self.data_groups
            slots, pages = self.cache_slots // G, self.num_pages // G
            turns = f", up to {self.max_turns} turns" if self.max_turns > 1 else ""
            head = (
                f"sampler: continuous engine, {G} data groups x ({slots} decode slots, "
                f"{pages} pages of {self.page_size} tokens = {(pages - 1) * self.page_size} "
                f"tokens); {self.sampler_prompts} prompts x {self.samples_per_prompt} samples "
                f"per step{turns}:"
            )
            cache = [_row("  KV page pool (group's share / chip)", self.kv_cache_bytes, _EXACT)]
            if self.max_turns > 1:
                held = f"exact: {self.waiting_pages // G} pages per group, no decode slot"
                cache += [_row("    held by sequences waiting on tools", self.waiting_bytes, held)]
            temps = [
                _row(f"  sampler temporaries ({name} chunk)", p.temporaries, self._source(p))
                for name, p in (("decode", self.sampler), ("prefill", self.prefill))
            ]
        else:
            head = (
                f"sampler: static, {self.sampler_prompts} prompts x {self.samples_per_prompt} "
                f"samples, {self.cache_slots} cache slots:"
            )
            cache = [_row("  KV cache", self.kv_cache_bytes, _EXACT)]
            label = "  sampler temporaries (incl. KV cache)"
            temps = [_row(label, self.sampler.temporaries, sampler_src)]
        return [
            head,
            *cache,
            _row("  parameters (sampling layout)", self.sampler_params_bytes, _EXACT),
            *temps,
            _row("  peak (+ resident train state)", self.sampling_peak, sampler_src),
        ]

    def _largest_sampler_line(self) -> str:
        continuous = self.engine == "continuous"
        what, unit = ("decode_slots", "slots") if continuous else ("sampler call", "prompts")
        return f"largest {what} that fits: {_rows(self.max_sampler_size, unit, self.sampler_bound)}"

    def _program_lines(self) -> list[str]:
        if not self.programs:
            return []
        total = sum(memory.compile_s for _, memory in self.programs)
        head = f"programs a run compiles: {len(self.programs)}, {total:.1f}s in all"
        out = [f"{head} ({self.compiler_name}):"]
        for name, memory in self.programs:
            refused = f" ({memory.refusal()})" if memory.out_of_memory else ""
            out.append(f"  {name:<44}{memory.compile_s:8.1f}s{refused}")
        return out

    @property
    def compiler_name(self) -> str:
        return "TPU compiler" if self.compiler.startswith("TPU") else "XLA:CPU estimate"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:8.2f}"


def _row(label: str, nbytes: float, source: str) -> str:
    """One row of the table: a label, GiB per device, where the figure is from."""
    return f"{label:<40}{_gib(nbytes)}  {source}"


def _rows(value: int | None, unit: str, bound: str = "") -> str:
    if value is None:
        return "not searched"
    found = f"{value} {unit}" if value > 0 else "none (even the smallest does not fit)"
    return f"{found}; {bound}" if bound else found
