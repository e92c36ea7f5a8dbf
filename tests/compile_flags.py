"""The test session's XLA:CPU optimisation level.

The suite's programs are tiny and most are compiled once, so XLA:CPU's backend optimisations
(LLVM -O2 by default) cost more compile time than they save at run time: at level 0 the whole
suite's test time fell from 3,057 s to 2,637 s on the 2-core machine (the sampler and
transformer tests alone: 46 s against 66 s). The flag is read by the CPU backend only: a program
compiled for TPU (the compile-only tests) comes out the same with and without it.

Subprocesses that train for hundreds of steps (the README's snippets, the demo sweep) run
faster at the default level: their environment drops the flag (:func:`optimized`). The README's
snippets run as a user's shell runs them (:func:`as_a_user`): without the session's eight fake
devices too. On the 2-core CI machine, a subprocess whose eight fake devices run collectives
while the test session's workers hold the cores once lost a collective's 40 s rendezvous.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

FAST_COMPILE = "--xla_backend_optimization_level=0"
FAKE_DEVICES = "--xla_force_host_platform_device_count=8"


def with_fast_compile(flags: str) -> str:
    """``flags`` with level 0, unless they name an optimisation level already."""
    if "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {FAST_COMPILE}".strip()


def optimized(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) without the session's level 0."""
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f != FAST_COMPILE)
    return env


def as_a_user(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """:func:`optimized` ``env`` without the session's eight fake CPU devices either."""
    env = optimized(env)
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if f != FAKE_DEVICES)
    return env
