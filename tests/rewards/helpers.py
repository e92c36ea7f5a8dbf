"""Shared helpers of the reward tests."""

import os

from delta_jax.rewards.code import _uid_range


def sandbox_processes(owners=None):
    """Pids of processes running under a sandbox uid of ``owners`` (the pids that started the
    sandboxes; default this process): there should be none after a run.

    Sandbox uids are per starting process, so the sandboxes that other test workers run at the
    same time (the suite runs modules in parallel) are not counted.
    """
    owners = [os.getpid()] if owners is None else owners
    uids = set().union(*(_uid_range(pid) for pid in owners))
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid in uids:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                continue
    return pids
