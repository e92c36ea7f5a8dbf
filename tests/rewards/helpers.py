"""Shared helpers of the reward tests."""

import os

from delta_jax.rewards.code import _UID_BASE


def sandbox_processes():
    """Pids of processes running under a sandbox uid (there should be none after a run)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid >= _UID_BASE:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                continue
    return pids
