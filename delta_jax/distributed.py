"""Multi-controller JAX: one process per host, started with ``jax.distributed.initialize``.

On a Cloud TPU slice (TPU VMs or GKE) every worker runs the same command and JAX discovers the
coordinator, the process count and this process's index itself. On CPU or GPU machines the
coordinator is explicit: :func:`initialize` takes it as arguments or from the environment
variables the launchers set (``launch/local_multiprocess.py``, ``launch/gke/jobset.yaml``):

* ``DELTA_JAX_COORDINATOR`` — ``host:port`` of process 0;
* ``DELTA_JAX_NUM_PROCESSES`` — number of processes;
* ``DELTA_JAX_PROCESS_ID`` — this process's index;
* ``DELTA_JAX_LOCAL_DEVICE_IDS`` — optional comma-separated local device ids.

CPU processes talk through gloo collectives. After initialisation every process sees all devices
(``jax.devices()``) and its own (``jax.local_devices()``); only process 0 should write logs, plots
and other single-copy files (:func:`is_main_process`, :func:`main_process_only`), while Orbax
checkpoints are written by all processes together.

Examples:
  >>> from delta_jax import distributed
  >>> distributed.initialize()  # no-op without a coordinator in the environment  # doctest: +SKIP
  >>> if distributed.is_main_process():  # doctest: +SKIP
  ...     print("only once")
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import logging
import os
import pkgutil
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from jax.experimental import multihost_utils

from delta_jax import extras

log = logging.getLogger(__name__)

ENV_COORDINATOR = "DELTA_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "DELTA_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "DELTA_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "DELTA_JAX_LOCAL_DEVICE_IDS"

_F = TypeVar("_F", bound=Callable[..., Any])
_initialized = False


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


def _on_tpu_vm() -> bool:
    # GKE TPU pods get the worker list in the environment; TPU VMs expose the accelerator device
    # files (JAX then reads the slice layout from the metadata server).
    env = (
        "TPU_WORKER_HOSTNAMES",
        "TPU_WORKER_ID",
        "CLOUD_TPU_TASK_ID",
        "MEGASCALE_COORDINATOR_ADDRESS",
    )
    if "tpu" not in os.environ.get("JAX_PLATFORMS", "tpu"):
        return False
    return any(os.environ.get(k) for k in env) or any(
        os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0")
    )


def _accelerator_plugins() -> list[str]:
    """JAX plugins for accelerators other than TPU (CUDA, ROCm, ...) installed here."""
    names = [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    try:  # an optional namespace package, present where a JAX plugin is installed
        import jax_plugins

        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        pass
    return names


def _tpu_attached() -> bool:
    """A TPU chip on this machine's PCI bus (Google's vendor id), or a TPU-VM environment."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if open(vendor).read().strip() == "0x1ae0":
                return True
        except OSError:
            continue
    return _on_tpu_vm()


def check_tpu_runtime() -> None:
    """Refuses to run where a TPU is attached but libtpu is missing (JAX would quietly run on
    the CPU); a user who chose other platforms (``JAX_PLATFORMS``) is left alone.

    Raises:
      extras.MissingExtra: naming the install of the ``tpu`` extra.
    """
    if "tpu" not in (os.environ.get("JAX_PLATFORMS") or "tpu"):
        return
    if _tpu_attached() and not extras.installed("tpu"):
        raise extras.MissingExtra(extras.missing("tpu", "this machine has a TPU: running on it"))


def leave_out_absent_tpu() -> bool:
    """Runs JAX on CPU where libtpu is installed but no TPU is attached and nothing else is.

    libtpu comes with the ``tpu`` and ``test`` extras, because the planner compiles for TPU
    topologies without a TPU. JAX's automatic platform choice then starts the TPU runtime on
    every command, which fails and prints its probe (host bounds, worker hostnames) to stderr
    before the command's first line. The commands call this first: when the user chose no
    platforms (``JAX_PLATFORMS``, ``JAX_FORCE_TPU_INIT``), no TPU is attached and no other
    accelerator plugin is installed, the CPU is the only backend JAX could start, so it is
    named. The planner's compile-only TPU client is unaffected (it loads libtpu itself).

    Returns:
      True when the platforms were set to CPU.
    """
    if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ:
        return False
    if jax.config.jax_platforms or _accelerator_plugins() or _tpu_attached():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    cpu_collectives: str = "gloo",
    timeout_s: int = 300,
) -> bool:
    """Starts multi-controller JAX if this is (part of) a multi-process job.

    Must run before anything touches devices. Arguments not given come from the
    ``DELTA_JAX_*`` environment variables; with neither a coordinator nor a TPU-VM environment
    it does nothing (a single-process run). Calling it twice is harmless.

    Args:
      coordinator_address: ``host:port`` of process 0 (CPU/GPU); None on TPU (auto-detected).
      num_processes: total processes.
      process_id: this process's index in ``[0, num_processes)``.
      local_device_ids: devices this process owns (GPU: one process per GPU); None for all.
      cpu_collectives: collectives implementation for CPU devices (``"gloo"`` or ``"mpi"``).
      timeout_s: how long to wait for every process to join.

    Returns:
      True when a multi-process job was initialised (now or earlier), False otherwise.

    Raises:
      ValueError: an incomplete or inconsistent explicit configuration.
    """
    global _initialized
    if _initialized:
        return True
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if local_device_ids is None and os.environ.get(ENV_LOCAL_DEVICE_IDS):
        local_device_ids = [int(i) for i in os.environ[ENV_LOCAL_DEVICE_IDS].split(",")]

    if coordinator_address is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ValueError(
                f"num_processes={num_processes} / process_id={process_id} given without a "
                f"coordinator address (argument or {ENV_COORDINATOR})"
            )
        if not _on_tpu_vm():
            return False
        jax.distributed.initialize(initialization_timeout=timeout_s)
    else:
        if num_processes is None or process_id is None:
            raise ValueError(
                f"coordinator_address={coordinator_address!r} needs num_processes and process_id "
                f"(arguments or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})"
            )
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id} not in [0, num_processes={num_processes})")
        if num_processes == 1:
            return False
        # The CPU client is created with its collectives at backend start-up; setting this on
        # GPU/TPU runs changes nothing there.
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=timeout_s,
        )
    _initialized = True
    log.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def is_main_process() -> bool:
    """True on process 0 (the one that logs, plots and writes single-copy files)."""
    return jax.process_index() == 0


def main_process_only(fn: _F) -> _F:
    """Decorator: run ``fn`` on process 0 only; other processes get None."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) if is_main_process() else None

    return wrapper  # type: ignore[return-value]


_BARRIER_TIMEOUT_S = 3600
_barriers: dict[str, int] = {}


def barrier(name: str, timeout_s: int = _BARRIER_TIMEOUT_S) -> None:
    """Blocks until every process reaches the barrier called ``name`` (no-op for one process).

    A wait on the coordination service (``jax.distributed``'s client), up to ``timeout_s``: a
    barrier that one process reaches minutes before another (the demo model warmed up on
    process 0) must not go through the CPU collectives, whose context setup gives up after 30
    s. Each use gets its own id (``name`` and how often this process has passed it: every
    process calls the same barriers in the same order). Without a client (JAX started its
    processes itself), a synchronisation of the devices.
    """
    if jax.process_count() == 1:
        return
    # Lazy: JAX's private distributed client, read only in a multi-process run.
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        multihost_utils.sync_global_devices(name)
        return
    _barriers[name] = _barriers.get(name, 0) + 1
    client.wait_at_barrier(f"delta_jax:{name}:{_barriers[name]}", timeout_s * 1000)


def broadcast_from_main(tree: Any) -> Any:
    """Process 0's value of a pytree of arrays / scalars on every process (e.g. a seed)."""
    if jax.process_count() == 1:
        return tree

    return multihost_utils.broadcast_one_to_all(tree)


def process_allgather(tree: Any, *, tiled: bool = False) -> Any:
    """Every process's value of a pytree of host-local arrays, as host numpy arrays.

    ``tiled=False`` stacks the processes' values on a new leading axis, ``tiled=True``
    concatenates them along axis 0 (e.g. per-process rows -> all rows). Global arrays sharded
    across processes are assembled whole.
    """
    return multihost_utils.process_allgather(tree, tiled=tiled)
