"""Logical axis names for the model's parameters and activations, and their mapping to a mesh.

Parameters carry logical names in their ``out_sharding`` metadata (for example the embedding is
``("vocab", "embed")``); key activations pass through :func:`constrain`, which is a no-op unless a
mesh (``jax.set_mesh``) and a rules table (``flax.core.spmd.logical_axis_rules``) are both active.
The project-wide rules table lives in ``delta_jax.sharding``; :data:`DEFAULT_RULES` here is only the
fallback that :func:`delta_jax.models.from_pretrained` uses when it is given a mesh and no rules.

Names: ``vocab`` V, ``embed`` H, ``heads`` N, ``kv_heads`` K, ``head_dim`` D, ``mlp`` F,
``layers`` L (stacked decoder blocks), ``batch`` B, ``length`` T (queries) and
``cache_length`` S (KV slots).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax.core import spmd
from jax.sharding import PartitionSpec

VOCAB = "vocab"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
LAYERS = "layers"
BATCH = "batch"
LENGTH = "length"
CACHE_LENGTH = "cache_length"

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# FSDP over the hidden dimension, tensor parallelism over heads / mlp / vocab, data over batch.
DEFAULT_RULES: Rules = (
    (BATCH, ("data", "fsdp")),
    (VOCAB, "tensor"),
    (EMBED, "fsdp"),
    (HEADS, "tensor"),
    (KV_HEADS, "tensor"),
    (MLP, "tensor"),
    (HEAD_DIM, None),
    (LAYERS, None),
    (LENGTH, None),
    (CACHE_LENGTH, None),
)


def logical_to_mesh(
    names: Sequence[str | None],
    rules: Rules,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Maps logical axis names to a ``PartitionSpec`` over mesh axes.

    The first rule naming a logical axis wins; unknown names are replicated. With ``mesh`` given,
    mesh axes it does not have (or of size 1) are dropped, a mesh axis is used at most once, and
    with ``shape`` given a dimension that the mesh axes do not divide evenly is replicated, so the
    result is always a valid sharding for that array.

    Args:
      names: one logical name (or None) per array dimension.
      rules: ``(logical_name, mesh_axis | tuple of mesh axes | None)`` pairs.
      mesh: optional mesh used to drop absent axes and check divisibility.
      shape: optional array shape, same length as ``names``.

    Returns:
      A ``PartitionSpec`` with one entry per dimension.

    Examples:
      >>> logical_to_mesh(("embed", "vocab"), DEFAULT_RULES)
      PartitionSpec('fsdp', 'tensor')
    """
    if shape is not None and len(shape) != len(names):
        raise ValueError(f"names {tuple(names)} and shape {tuple(shape)} differ in length")
    table: dict[str, tuple[str, ...]] = {}
    for logical, physical in rules:
        if logical in table:
            continue
        if physical is None:
            table[logical] = ()
        elif isinstance(physical, str):
            table[logical] = (physical,)
        else:
            table[logical] = tuple(physical)
    sizes = dict(mesh.shape) if mesh is not None else None
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        axes = table.get(name, ()) if name is not None else ()
        axes = tuple(a for a in axes if a not in used)
        if sizes is not None:
            axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
            if shape is not None:
                total = 1
                for a in axes:
                    total *= sizes[a]
                if shape[dim] % total:
                    axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; identity unless a mesh and rules are both active.

    Args:
      x: any array.
      names: one logical name (or None) per dimension of ``x``.

    Returns:
      ``x``, constrained to the sharding the active rules give ``names``.
    """
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_mesh(names, rules, mesh, x.shape))
