"""XLA compilation seen from a run: JAX's persistent compilation cache, and what each step compiled.

JAX compiles a program the first time it meets its shapes, in every process. Its persistent
compilation cache keeps each compiled executable on disk, keyed by the program, its compile
options and the JAX, jaxlib and backend versions; a later process with the same program (a
resumed run, another seed, ``compare``'s sweep, the same config again) loads it instead of
compiling. ``run.compile_cache`` (:func:`use_persistent_cache`): ``auto`` is
``JAX_COMPILATION_CACHE_DIR`` when that is set, else ``<project cache>/xla`` (the project cache
is ``$DELTA_JAX_CACHE``, default ``~/.cache/delta_jax``); a path puts it there; null turns it
off. Every program is cached, however quickly it compiled (JAX's default skips those under a
second; ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` still sets it). Off the GPU the keys do
not depend on the directory's path, so a cache copied elsewhere (another machine of the same
kind, a Kaggle data set) is found there too. JAX caches on CPU, GPU
and TPU alike when the backend can serialise its executables (jaxlib's CPU, CUDA and TPU
clients do). The cache is trusted: whoever can write to its directory can run code in the
processes that read it.

:class:`CompileCounter` counts, from JAX's monitoring events, the programs compiled, those
loaded from the persistent cache and the seconds spent lowering and compiling (or loading)
them; tracing aside, whose events nest (a jitted function traced inside another reports both);
the trainer logs each step's share as ``compiles``, ``compiles_loaded`` and
``time/compile``.
"""

from __future__ import annotations

import os
import threading

import jax
from jax.experimental.compilation_cache import compilation_cache

from delta_jax.models.pypi import cache_dir

_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"  # a compile or a load from the cache
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def use_persistent_cache(setting: str | None) -> str | None:
    """Points JAX's persistent compilation cache at ``setting`` (see the module); returns the
    directory in use, or None when off."""
    if setting is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") if setting == "auto" else setting
    path = os.path.expanduser(path or str(cache_dir() / "xla"))
    jax.config.update("jax_enable_compilation_cache", True)
    if jax.config.jax_compilation_cache_dir != path:
        compilation_cache.reset_cache()  # a cache opened on another directory is dropped
        compilation_cache.set_cache_dir(path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX also points XLA's GPU autotuning cache at a folder inside this one, through the
    # compile options, which are part of every key: a copied or moved cache would miss. Off the
    # GPU that cache does nothing, and without it the keys do not name the folder.
    keep = os.environ.get("JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES")
    if keep is None and jax.default_backend() != "gpu":
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    return path


class CompileCounter:
    """Programs this process compiled, loaded from the persistent cache, and the seconds spent
    lowering and compiling them (jitted programs and eager ops alike).

    A load is a compile event that JAX preceded by a persistent-cache hit on the same thread.
    """

    compiled = 0
    loaded = 0
    seconds = 0.0
    _hits = threading.local()
    _registered = False

    @classmethod
    def install(cls) -> None:
        if not cls._registered:
            jax.monitoring.register_event_listener(cls._on_event)
            jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
            cls._registered = True

    @classmethod
    def snapshot(cls) -> tuple[int, int, float]:
        return cls.compiled, cls.loaded, cls.seconds

    @classmethod
    def since(cls, snapshot: tuple[int, int, float]) -> dict[str, float]:
        """The step's metrics: what happened since ``snapshot``."""
        compiled, loaded, seconds = snapshot
        return {
            "compiles": cls.compiled - compiled,
            "compiles_loaded": cls.loaded - loaded,
            "time/compile": cls.seconds - seconds,
        }

    @classmethod
    def _on_event(cls, name: str, **kwargs) -> None:
        if name == _CACHE_HIT:
            cls._hits.pending = getattr(cls._hits, "pending", 0) + 1

    @classmethod
    def _on_duration(cls, name: str, duration: float, **kwargs) -> None:
        if name == _LOWER:
            cls.seconds += duration
        elif name == _COMPILE:
            cls.seconds += duration
            if getattr(cls._hits, "pending", 0):
                cls._hits.pending -= 1
                cls.loaded += 1
            else:
                cls.compiled += 1


def warm_up_rollout(sampler, params, prompts: int, n: int, lengths: tuple[int, int], **sampling):
    """Compiles the rollout engine's programs ahead: runs the rollout's request (``prompts``
    prompts of ``n`` samples, ``lengths`` the run's longest prompt and response, ``sampling``
    the rollout's ``generate`` settings) once per prompt bucket up to the longest prompt, with
    prompts of that length, one row decoding to the longest response and the others one token:
    each is a request shape's first, whose programs the engine compiles before it runs (every
    decode chunk's slot bucket, every prefill length). The outputs are dropped. Returns the
    requests run."""
    prompt_len, gen_len = lengths
    floor = sampler.buckets.min_length
    sizes = sorted(
        {min(max(floor, 1 << (j - 1).bit_length()), prompt_len) for j in range(1, prompt_len + 1)}
    )
    budgets = [gen_len] + [1] * (prompts * n - 1)
    for size in sizes:
        sampler.generate(
            [[1] * size] * prompts, n=n, max_new_tokens=budgets, seed=0, params=params, **sampling
        )
    return len(sizes)
