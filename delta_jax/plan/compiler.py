"""Which compiler plans (the TPU compiler, compile-only, or an XLA:CPU estimate), the slice's
devices for it, and compiling one program into its :class:`ProgramMemory`."""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import time
from collections.abc import Callable

import jax
from jax.experimental import topologies

from delta_jax import extras
from delta_jax import sharding as sh
from delta_jax.plan.report import ProgramMemory


def tpu_compiler_available() -> bool:
    """Whether the TPU compiler (``libtpu``, the ``tpu`` extra) can be loaded."""
    return extras.installed("tpu")


def resolve_compiler(compiler: str) -> tuple[str, str]:
    """``("tpu" | "cpu", why)`` for ``--compiler auto | tpu | cpu``."""
    if compiler not in ("auto", "tpu", "cpu"):
        raise ValueError(f"--compiler={compiler!r}; expected 'auto', 'tpu' or 'cpu'")
    if compiler == "cpu":
        return "cpu", "--compiler cpu"
    if tpu_compiler_available():
        return "tpu", f"libtpu {importlib.metadata.version('libtpu')}"
    if compiler == "tpu":
        raise extras.MissingExtra(extras.missing("tpu", "--compiler tpu"))
    return "cpu", f"libtpu not importable ({extras.install_command('tpu')} for TPU figures)"


def chip_grid(chips: int, dims: int) -> tuple[int, ...]:
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
    # Compile-only use touches no chip: several processes (parallel plans, tests) may load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    chips = sh.topology(topology_name).chips
    gen = topology_name.strip().lower().split("-")[0].replace("v5litepod", "v5e")
    grid = chip_grid(chips, 3 if gen in ("v4", "v5p") else 2)
    name = f"{gen}:{'x'.join(map(str, grid))}"
    kwargs = {}
    if chips < 4:  # the default host bounds (2x2x1) do not divide a smaller slice
        kwargs["chips_per_host_bounds"] = (*grid, 1, 1)[:3]
    desc = topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs)
    return name, list(desc.devices)


# The TPU compiler's refusals for lack of memory (RESOURCE_EXHAUSTED), as libtpu 0.0.42.1 words
# them (tests/plan/test_plan.py holds captured ones): HBM, "Ran out of memory on HBM, the total
# memory required for HLO temporaries (47.68G) exceeds available HBM (15.75G)" or
# "CompileTimeHbmOom ... Program hbm requirement 9.08G"; an on-core memory, "Allocation
# (size=1769472) would exceed memory (size=1048576) :: ... space=smem ..." or "Ran out of
# memory in memory space vmem".
_HBM_NEED = re.compile(r"(?:HLO temporaries \(|Program hbm requirement )([\d.]+)([KMGT])")
_SPACE = re.compile(r"space=(\w+)|memory space (\w+)|on (HBM)")


def compiler_refusal(err: BaseException) -> tuple[str, int] | None:
    """``(memory, bytes needed)`` when ``err`` is the compiler refusing a program for lack of
    memory (``"HBM"``, ``"SMEM"``, ``"VMEM"``; bytes: what the message states for HBM, else 0);
    None for any other error.
    """
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    need = _HBM_NEED.search(text)
    if need is not None:
        return "HBM", int(float(need.group(1)) * 1024 ** ("KMGT".index(need.group(2)) + 1))
    space = _SPACE.search(text)
    name = next((g for g in space.groups() if g), "") if space else ""
    return (name.upper() or "memory"), 0


def plan_mesh(config, topology_name: str, compiler: str):
    """The run's mesh on the slice's devices for ``compiler``, and the compiler described."""
    kind, why = resolve_compiler(compiler)
    if kind == "tpu":
        grid, devices = tpu_topology_devices(topology_name)
        mesh = sh.make_mesh(*config.run.mesh, devices=devices)
        return mesh, f"TPU compiler, compile-only for {grid} ({why})"
    mesh = sh.mesh_from_config(config.run.mesh, topology_name=topology_name)
    return mesh, f"XLA:CPU on {mesh.size} stand-in devices, an estimate ({why})"


def compile_program(lower: Callable, mesh, rules) -> ProgramMemory:
    """Lowers and compiles one program; a refusal for lack of memory (any memory: HBM, SMEM,
    VMEM) is a :class:`ProgramMemory` with ``refused`` set, never an exception."""
    start = time.perf_counter()
    with sh.use_mesh(mesh, rules):
        lowered = lower()
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as err:
            refusal = compiler_refusal(err)
            if refusal is None:
                raise
            space, need = refusal
            elapsed = time.perf_counter() - start
            return ProgramMemory(0, 0, 0, need, elapsed, out_of_memory=True, refused=space)
    return ProgramMemory.of(compiled, time.perf_counter() - start)


# Collective ops of an optimised HLO module and the result shape they produce per device.
_COLLECTIVE = re.compile(
    r"= (\(?[^=]*?\)?) (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
    r"(?:-start)?\("
)

_SHAPE = re.compile(r"(pred|[suf]\d+|bf16)\[([\d,]*)\]")


def collective_bytes(hlo: str) -> int:
    """Bytes the collectives of a compiled (per-device) HLO module produce on one device."""
    total = 0
    for match in _COLLECTIVE.finditer(hlo):
        for dtype, dims in _SHAPE.findall(match.group(1)):
            bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype))
            total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total
