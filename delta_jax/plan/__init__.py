"""Memory planner: will this run fit a TPU slice, and with what micro-batch?

``delta-jax plan --config configs/qwen3_8b_delta.yaml --topology v5p-64`` builds the model
abstractly (``nnx.eval_shape``, no weights allocated), lowers and compiles the run's train step
and its sampler program for the real shapes, and reads each program's per-device memory from the
compiler's buffer assignment (``compiled.memory_analysis()``). Two compilers:

* the TPU compiler (when ``libtpu`` is importable: ``pip install -e ".[tpu]"``): the programs
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

The package, in data-flow order: :mod:`.models` (which model), :mod:`.compiler` (which compiler
and devices, one program compiled), :mod:`.programs` (the run's programs, built abstractly),
:mod:`.search` (:func:`plan`: compile, report, search), :mod:`.roofline` (the RL step's time
bounds from the compiler's cost analysis and the chip's peaks), :mod:`.lengths` and
:mod:`.schedules` (the rollout at a response-length distribution: synchronous, partial,
asynchronous on split meshes), :mod:`.report` (the figures and their table), :mod:`.cli`
(``delta-jax plan``).
"""

from delta_jax.plan.cli import build_parser, main, run
from delta_jax.plan.compiler import resolve_compiler, tpu_compiler_available, tpu_topology_devices
from delta_jax.plan.lengths import Lengths, parse_lengths
from delta_jax.plan.models import KNOWN_MODELS, known_model_config, resolve_model_config
from delta_jax.plan.report import PlanReport, ProgramMemory, SplashCalls
from delta_jax.plan.roofline import Workload
from delta_jax.plan.search import compile_train_step, largest_fitting, plan

__all__ = [
    "KNOWN_MODELS",
    "Lengths",
    "PlanReport",
    "ProgramMemory",
    "SplashCalls",
    "Workload",
    "build_parser",
    "compile_train_step",
    "known_model_config",
    "largest_fitting",
    "main",
    "parse_lengths",
    "plan",
    "resolve_compiler",
    "resolve_model_config",
    "run",
    "tpu_compiler_available",
    "tpu_topology_devices",
]
