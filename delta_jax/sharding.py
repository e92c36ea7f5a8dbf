"""Device meshes, logical-axis rules, and placement of parameters, optimiser state and batches.

The mesh has three axes: ``data`` (pure data parallelism: replicas of the parameters), ``fsdp``
(data parallelism whose replicas also split the parameters and optimiser state along the hidden
dimension, gathered per layer by the compiler) and ``tensor`` (Megatron-style splitting of heads,
MLP columns and the vocabulary). Arrays are placed by the logical names their dimensions carry
(``delta_jax.models.axes``), mapped to mesh axes by one of two tables:

* :data:`TRAIN_RULES` (the models package's :data:`~delta_jax.models.axes.DEFAULT_RULES`): rows over
  ``(data, fsdp)``, hidden over ``fsdp``, heads / MLP / vocab over ``tensor``;
* :data:`SAMPLE_RULES` (used by the sampler): the same, except that nothing is split over the
  hidden dimension, so that a decode step pays no FSDP gather.

:func:`reshard_for_sampling` moves only the parameters whose placement (or dtype) differs
between the trainer's and the sampler's layout, on device; :func:`sampling_mesh` regroups the
trainer's devices for tensor-parallel decoding. In a multi-process (multi-host) run every
process calls the same functions with the same arguments; per-process batches become global
arrays with :func:`host_local_batch_to_global`.

Examples:
  >>> mesh = make_mesh(2, 2, 2)  # doctest: +SKIP
  >>> params = shard_params(params, mesh)  # doctest: +SKIP
  >>> step = make_train_step(graphdef, opt, update_plan,
  ...                        jit_kwargs=train_jit_kwargs(state, mesh))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from delta_jax.models.axes import BATCH, DEFAULT_RULES, Rules, logical_to_mesh

AXES = ("data", "fsdp", "tensor")
TRAIN_RULES: Rules = DEFAULT_RULES
# Logical axis -> mesh axes while sampling. Unlike training, nothing is sharded over the hidden
# dimension (no FSDP gathers per decode step): rows spread over every data-like axis, heads and
# the vocabulary over ``tensor``; the cache follows its rows and KV heads.
SAMPLE_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("kv_heads", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("embed", None),
    ("head_dim", None),
    ("layers", None),
    ("length", None),
    ("cache_length", None),
)

_GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Topology:
    """A Cloud TPU slice: how many chips, and the HBM of one chip.

    Attributes:
      name: e.g. ``"v5p-64"``.
      chips: JAX devices of the slice (a v4/v5p chip is one megacore device).
      hbm_bytes: HBM of one chip.
      chips_per_host: chips attached to one TPU-VM worker.
    """

    name: str
    chips: int
    hbm_bytes: int
    chips_per_host: int

    @property
    def hosts(self) -> int:
        return max(1, self.chips // self.chips_per_host)


# generation -> (TensorCores per chip in the slice name, HBM GiB per chip, chips per host).
# v4 and v5p names count TensorCores (two per chip); v5e and v6e names count chips.
_GENERATIONS = {
    "v4": (2, 32, 4),
    "v5p": (2, 95, 4),
    "v5e": (1, 16, 4),
    "v5litepod": (1, 16, 4),
    "v6e": (1, 32, 4),
}


def topology(name: str) -> Topology:
    """Parses a TPU slice name such as ``v5p-64``, ``v4-32``, ``v5e-8`` or ``v6e-1``.

    Args:
      name: ``<generation>-<size>``; generation one of v4, v5p, v5e (or v5litepod), v6e.

    Returns:
      The :class:`Topology` (chips = size / 2 for v4 and v5p, whose names count TensorCores).

    Examples:
      >>> topology("v5p-64").chips, topology("v5e-8").chips
      (32, 8)
    """
    match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name.strip().lower())
    if match is None:
        raise ValueError(
            f"topology={name!r}: expected <generation>-<size> with generation in "
            f"{sorted(_GENERATIONS)}, e.g. v5p-64, v4-32, v5e-8, v6e-1"
        )
    gen, size = match.group(1), int(match.group(2))
    cores, hbm_gib, per_host = _GENERATIONS[gen]
    if size < cores or size % cores:
        raise ValueError(f"topology={name!r}: size must be a multiple of {cores} for {gen}")
    chips = size // cores
    return Topology(
        name=name, chips=chips, hbm_bytes=hbm_gib * _GiB, chips_per_host=min(per_host, chips)
    )


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, int, int]:
    """Replaces the (at most one) ``-1`` in ``(data, fsdp, tensor)`` by the remaining devices.

    Examples:
      >>> resolve_mesh_shape((-1, 2, 1), 8)
      (4, 2, 1)
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3:
        raise ValueError(f"mesh shape {shape} must have 3 entries (data, fsdp, tensor)")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh shape {shape}: each entry >= 1, at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"mesh shape {shape}: {num_devices} devices not divisible by {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices, have {num_devices}")
    return shape  # type: ignore[return-value]


def make_mesh(
    data: int = -1,
    fsdp: int = 1,
    tensor: int = 1,
    *,
    topology_name: str | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over all (or the given) devices, with auto axes.

    Devices are ordered by process first, so in a multi-host run ``data`` (then ``fsdp``) spans
    the hosts and each process's devices hold a contiguous block of batch rows, which is what
    :func:`host_local_batch_to_global` needs. On TPU the physical topology picks the order.

    Args:
      data, fsdp, tensor: axis sizes; one of them may be -1 (the remaining devices).
      topology_name: plan for a TPU slice (e.g. ``"v5p-64"``) on stand-in devices: the mesh takes
        that slice's number of chips from the available (e.g. fake CPU) devices.
      devices: the devices to use (default ``jax.devices()``).

    Returns:
      A ``jax.sharding.Mesh`` with axis names ``("data", "fsdp", "tensor")``.

    Examples:
      >>> make_mesh(-1, 2, 1).shape  # on 8 devices  # doctest: +SKIP
      {'data': 4, 'fsdp': 2, 'tensor': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    if topology_name is not None:
        chips = topology(topology_name).chips
        if len(devices) < chips:
            raise ValueError(
                f"topology={topology_name!r} needs {chips} devices, this process has "
                f"{len(devices)}; start JAX with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={chips} to plan on CPU"
            )
        devices = devices[:chips]
    shape = resolve_mesh_shape((data, fsdp, tensor), len(devices))
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    # JAX lays meshes out over the physical torus for one device per chip; a slice with one
    # device per TensorCore (v4's compile-only topology: two per chip) keeps the id order.
    per_chip = all(getattr(d, "core_on_chip", 0) == 0 for d in devices)
    if devices[0].platform == "tpu" and topology_name is None and per_chip:
        grid = mesh_utils.create_device_mesh(shape, devices)
    else:
        grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def mesh_from_config(mesh: Sequence[int], topology_name: str | None = None) -> Mesh:
    """The mesh of ``run.mesh`` (``(data, fsdp, tensor)``, -1 = the rest)."""
    return make_mesh(*mesh, topology_name=topology_name)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules = TRAIN_RULES) -> Iterator[None]:
    """Activates ``mesh`` and ``rules`` so the model's ``constrain`` calls take effect.

    Trace (first call / ``.lower``) a jitted function inside this context to get the activation
    sharding constraints; outside it they are no-ops.
    """
    with jax.set_mesh(mesh), spmd.logical_axis_rules(rules):
        yield


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def logical_sharding(
    names: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh, rules: Rules
) -> NamedSharding:
    """``NamedSharding`` for an array of ``shape`` whose dimensions carry logical ``names``."""
    if not names:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, logical_to_mesh(names, rules, mesh, tuple(shape)))


def _variable_sharding(var: nnx.Variable, mesh: Mesh, rules: Rules) -> nnx.Variable:
    names = var.get_metadata().get("out_sharding")
    # The Variable wrapper is kept so the result has the same pytree structure as the state.
    return var.replace(logical_sharding(names, var.get_value().shape, mesh, rules))


def param_shardings(abstract_params: Any, mesh: Mesh, rules: Rules = TRAIN_RULES) -> Any:
    """Shardings of a parameter state from its variables' logical-axis metadata.

    Args:
      abstract_params: an ``nnx.State`` of ``nnx.Param`` (arrays or ``ShapeDtypeStruct``s, e.g.
        ``nnx.split(nnx.eval_shape(lambda: Transformer(cfg)), nnx.Param)[1]``).
      mesh: the device mesh.
      rules: logical name -> mesh axes (``TRAIN_RULES`` or ``SAMPLE_RULES``).

    Returns:
      The same structure with a ``NamedSharding`` in place of every array (usable as a jit
      ``in_shardings`` / ``out_shardings`` entry). A dimension that the mesh axes do not divide,
      and any variable without logical names, is replicated.
    """
    return jax.tree.map(
        lambda v: (
            _variable_sharding(v, mesh, rules)
            if _is_variable(v)
            else NamedSharding(mesh, PartitionSpec())
        ),
        abstract_params,
        is_leaf=_is_variable,
    )


def _put(x: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if not sharding.is_fully_addressable and isinstance(x, jax.Array) and x.is_fully_addressable:
        # A process-local array (e.g. freshly loaded on this host's first device) cannot be
        # resharded across hosts directly; every process holds the same value, so it is placed
        # from the host copy (device_put checks that the processes agree).
        x = np.asarray(x)
    return jax.device_put(x, sharding)


def shard_params(params: Any, mesh: Mesh, rules: Rules = TRAIN_RULES) -> Any:
    """Places a parameter state on ``mesh`` by its logical-axis metadata (see param_shardings)."""
    shardings = param_shardings(params, mesh, rules)
    return jax.tree.map(_put, params, shardings)


def state_shardings(abstract_state: Any, mesh: Mesh, rules: Rules = TRAIN_RULES) -> Any:
    """Shardings of a whole ``TrainState`` (or any pytree holding ``nnx.Param`` variables).

    The optimiser's moments are trees of the same ``nnx.Param`` variables as the parameters
    (optax maps over them, keeping their metadata), so they mirror the parameters' placement;
    every other leaf (step counters, schedule counts) is replicated.

    Args:
      abstract_state: e.g. ``jax.eval_shape(init_train_state, params, optimizer)``.
      mesh: the device mesh.
      rules: logical-axis rules (training: ``TRAIN_RULES``).

    Returns:
      A pytree of ``NamedSharding`` with the structure of ``abstract_state``.
    """
    return param_shardings(abstract_state, mesh, rules)


def batch_spec(mesh: Mesh, rules: Rules = TRAIN_RULES) -> PartitionSpec:
    """``PartitionSpec`` of a ``[M, b, ...]`` batch field: rows over the ``batch`` rule's axes."""
    return PartitionSpec(None, logical_to_mesh((BATCH,), rules, mesh)[0])


def batch_sharding(mesh: Mesh, rules: Rules = TRAIN_RULES) -> NamedSharding:
    """``NamedSharding`` of every ``TrainBatch`` field ``[M, b, ...]``: b over ``(data, fsdp)``.

    One sharding serves all fields (a jit ``in_shardings`` prefix): dimensions past ``b`` are
    replicated. ``b`` must be a multiple of :func:`batch_divisor`.
    """
    return NamedSharding(mesh, batch_spec(mesh, rules))


def batch_divisor(mesh: Mesh, rules: Rules = TRAIN_RULES) -> int:
    """How many shards the batch rows are split into (rows must be a multiple of it)."""
    return math.prod(mesh.shape[a] for a in batch_axes(mesh, rules))


def batch_axes(mesh: Mesh, rules: Rules = TRAIN_RULES) -> tuple[str, ...]:
    """The mesh axes the batch rows are split over (e.g. ``("data", "fsdp")``)."""
    axes = logical_to_mesh((BATCH,), rules, mesh)[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def rows_sharding(mesh: Mesh, row_axis: int, rules: Rules = TRAIN_RULES) -> NamedSharding:
    """Sharding of an array whose dimension ``row_axis`` holds batch rows (the rest replicated)."""
    return NamedSharding(mesh, PartitionSpec(*([None] * row_axis), batch_spec(mesh, rules)[1]))


def train_jit_kwargs(abstract_state: Any, mesh: Mesh, rules: Rules = TRAIN_RULES) -> dict:
    """``jit_kwargs`` for ``make_train_step``: state and batch shardings in, state out.

    Metrics (scalars) come out replicated, so every process can read them.
    """
    state = state_shardings(abstract_state, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    return dict(
        in_shardings=(state, batch_sharding(mesh, rules)), out_shardings=(state, replicated)
    )


def sampling_mesh(mesh: Mesh, kv_heads: int) -> Mesh:
    """The sampler's mesh: the trainer's devices regrouped for tensor-parallel decoding.

    Decoding reads every weight once per step, so the sampler wants each weight split over
    chips (never gathered per step, as an FSDP layout would) and each sequence's KV cache split
    by its KV heads. The same devices, in the same order, are regrouped as ``(data, 1, tensor)``
    with ``tensor = gcd(kv_heads, devices)``: heads, MLP columns, the vocabulary and the KV
    heads split over ``tensor`` (:data:`SAMPLE_RULES`), decode slots over ``data``.

    Examples:
      >>> sampling_mesh(make_mesh(1, 32, 1), kv_heads=8).shape  # doctest: +SKIP
      {'data': 4, 'fsdp': 1, 'tensor': 8}
    """
    tensor = math.gcd(kv_heads, mesh.size)
    grid = mesh.devices.reshape(mesh.size // tensor, 1, tensor)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def reshard_for_sampling(
    params: Any,
    mesh: Mesh,
    rules: Rules = SAMPLE_RULES,
    train_rules: Rules = TRAIN_RULES,
    *,
    sample_mesh: Mesh | None = None,
    dtype: Any = None,
) -> Any:
    """The trainer's parameters in the sampler's layout, moved and cast on device where needed.

    Leaves whose sampling placement and dtype equal their training ones are returned as they
    are (no copy); the others are moved and cast in one jitted program (an all-gather over
    ``fsdp``, or the regrouping onto :func:`sampling_mesh`, with the cast fused in).

    Args:
      params: the trainer's parameter state (placed by ``train_rules`` on ``mesh``).
      mesh: the trainer's mesh.
      rules: the sampler's rules.
      train_rules: the rules ``params`` was placed with.
      sample_mesh: the sampler's mesh (the same devices, or others: the leaves are copied
        there first); default ``mesh``.
      dtype: the sampler's weight dtype (the model's compute dtype), or None to keep each
        leaf's own; only floating-point leaves are cast.

    Returns:
      A parameter state with the sampler's placement and dtype.
    """
    target = param_shardings(params, sample_mesh or mesh, rules)
    source = param_shardings(params, mesh, train_rules)
    leaves, treedef = jax.tree.flatten(params)
    target_leaves = jax.tree.leaves(target)
    dtypes = [sampling_dtype(x.dtype, dtype) for x in leaves]
    moved = [
        i
        for i, (s, t) in enumerate(zip(jax.tree.leaves(source), target_leaves, strict=True))
        if s != t or dtypes[i] != leaves[i].dtype
    ]
    if not moved:
        return params
    targets = tuple(target_leaves[i] for i in moved)
    program = resharder(targets, tuple(dtypes[i] for i in moved))
    inputs = [leaves[i] for i in moved]
    if sample_mesh is not None and set(sample_mesh.devices.flat) != set(mesh.devices.flat):
        inputs = [move_to(x, t) for x, t in zip(inputs, targets, strict=True)]  # cast there
    for i, x in zip(moved, program(*inputs), strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def move_to(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """A device array placed by ``sharding``, copied device to device; across processes between
    different device sets (an asynchronous run's sampler and trainer), which JAX's CPU and GPU
    runtimes do not copy, gathered to every host and placed from there."""
    if jax.process_count() == 1 or x.sharding.device_set == sharding.device_set:
        return jax.device_put(x, sharding)
    # Gathered on its own devices only (collectives on others would meet the other side's).
    whole = np.asarray(_replicate(x.sharding.mesh)(x).addressable_data(0))
    return jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])


@functools.lru_cache(maxsize=8)
def _replicate(mesh: Mesh):
    """The jitted copy of an array onto every device of ``mesh``."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def sampling_dtype(have: Any, want: Any) -> np.dtype:
    """A leaf's dtype in the sampling layout: ``want`` for floating-point leaves, else its own."""
    floating = want is not None and np.issubdtype(have, np.floating)
    return np.dtype(want if floating else have)


@functools.lru_cache(maxsize=32)
def resharder(shardings: tuple[NamedSharding, ...], dtypes: tuple[np.dtype, ...]):
    """The jitted move of leaves into ``shardings`` cast to ``dtypes`` (what
    :func:`reshard_for_sampling` runs; the planner compiles it for its figures). One program per
    target layout, reused every RL step (no recompilation)."""

    def move(*xs):
        return tuple(x.astype(d) for x, d in zip(xs, dtypes, strict=True))

    return jax.jit(move, out_shardings=shardings)


def host_local_batch_to_global(
    batch: Any, mesh: Mesh, rules: Rules = TRAIN_RULES, *, row_axis: int = 1
) -> Any:
    """Global ``[M, b, ...]`` arrays from each process's own rows ``[M, b / processes, ...]``.

    Every process passes its rows (numpy or host-local arrays); process ``p``'s rows become rows
    ``[p * b_local, (p + 1) * b_local)`` of the global batch (the mesh puts each process's devices
    on a contiguous block of the row axis). With one process this is a sharded ``device_put``.

    Args:
      batch: a pytree (e.g. ``TrainBatch``) of arrays ``[M, b_local, ...]``; None leaves stay None.
      mesh: the mesh; the row axis is split by :func:`batch_sharding`.
      rules: logical-axis rules.
      row_axis: the rows' dimension: 1 for ``[M, b, ...]`` train batches, 0 for ``[b, ...]``
        arrays (e.g. the old-policy pass's inputs).

    Returns:
      The same pytree of global ``jax.Array``s.

    Raises:
      ValueError: a leaf with fewer than 2 dimensions, or rows that do not split evenly.
    """
    rows_spec = batch_spec(mesh, rules)[1]
    divisor = batch_divisor(mesh, rules)
    processes = jax.process_count()

    def put(path, x):
        x = np.asarray(x)
        name = jax.tree_util.keystr(path)
        if x.ndim <= row_axis:
            want = "[M, b, ...]" if row_axis == 1 else "[b, ...]"
            raise ValueError(f"batch field {name} has shape {x.shape}; expected {want}")
        rows = x.shape[row_axis] * processes
        if rows % divisor:
            raise ValueError(
                f"batch field {name}: {rows} global rows (shape {x.shape} per process x "
                f"{processes} processes) not divisible by the {divisor} batch shards of mesh "
                f"{dict(mesh.shape)}"
            )
        global_shape = (*x.shape[:row_axis], rows, *x.shape[row_axis + 1 :])
        spec = PartitionSpec(*([None] * row_axis), rows_spec)
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x, global_shape)

    return jax.tree_util.tree_map_with_path(put, batch)


def replicated_to_global(
    batch: Any, mesh: Mesh, rules: Rules = TRAIN_RULES, *, row_axis: int = 1
) -> Any:
    """Global arrays, rows split by :func:`batch_sharding`, from a batch every process holds whole.

    For host-replicated data (every process computed the same rollout batch): each device takes
    its rows straight from the local copy, whatever the device order, with no cross-host traffic.
    Leaves that already are global device arrays (e.g. old log-probs computed on the mesh) are
    resharded on device instead.

    Args:
      batch: a pytree of arrays whose dimension ``row_axis`` is the global rows; None stays None.
      mesh: the mesh.
      rules: logical-axis rules.
      row_axis: 1 for ``[M, b, ...]`` train batches, 0 for ``[b, ...]``.

    Returns:
      The same pytree of global ``jax.Array``s.
    """
    spec = PartitionSpec(*([None] * row_axis), batch_spec(mesh, rules)[1])
    sharding = NamedSharding(mesh, spec)
    divisor = batch_divisor(mesh, rules)

    def put(path, x):
        if x.ndim <= row_axis or x.shape[row_axis] % divisor:
            raise ValueError(
                f"batch field {jax.tree_util.keystr(path)} of shape {x.shape}: dimension "
                f"{row_axis} must hold the rows, a multiple of the {divisor} batch shards of mesh "
                f"{dict(mesh.shape)}"
            )
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding == sharding else move_to(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree_util.tree_map_with_path(put, batch)
