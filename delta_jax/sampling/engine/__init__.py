"""The continuous-batching engine: a host scheduler over requests, slots and pages
(:mod:`~delta_jax.sampling.engine.scheduler`) with each data group's slots and page accounting
(:mod:`~delta_jax.sampling.engine.groups`), the protocol it calls the device through
(:mod:`~delta_jax.sampling.engine.protocol`), the device programs as pure functions (the
decode chunk, :mod:`~delta_jax.sampling.engine.chunk`, with its plain or verify step; the rest,
:mod:`~delta_jax.sampling.engine.decode`), their compilation and state
(:mod:`~delta_jax.sampling.engine.programs`), one request's types
(:mod:`~delta_jax.sampling.engine.requests`), their sizing
(:mod:`~delta_jax.sampling.engine.sizing`), and the engine that puts them together for one
request (:mod:`~delta_jax.sampling.engine.engine`)."""

from delta_jax.sampling.engine.engine import EngineSetup, generate_continuous, run_engine
from delta_jax.sampling.engine.programs import ProgramCache
from delta_jax.sampling.engine.requests import EngineRows, EngineSpec, EngineStats, Turns
from delta_jax.sampling.engine.sizing import EngineSettings, RequestShape, size_engine

__all__ = [
    "EngineRows",
    "EngineSettings",
    "EngineSetup",
    "EngineSpec",
    "EngineStats",
    "ProgramCache",
    "RequestShape",
    "Turns",
    "generate_continuous",
    "run_engine",
    "size_engine",
]
