"""Hugging Face hub ids: one download per host, and errors that say what went wrong.

Models (``huggingface_hub.snapshot_download``) and data sets (``datasets.load_dataset``) resolve
hub ids as every Hugging Face tool does: download on first use into the usual cache (progress
bars, resumable), then read the cache; ``HF_HUB_OFFLINE=1`` reads the cache only; ``HF_ENDPOINT``
and ``HF_TOKEN`` are honoured by the libraries themselves.

**One download per host.** Every process of a run resolves the same ids. :func:`download_lock`
is an inter-process file lock in the hub cache directory, keyed by the id: the first process on a
host downloads, the others block on the lock and then find everything in the cache. A file lock
rather than a JAX barrier because the cache is per host (a barrier over all hosts would make
every host wait for one host's download and still leave the other hosts' caches empty), and
because it also covers processes of one host that share a cache without ``jax.distributed``
(the local multi-process launcher, GPU hosts with one process per device). The libraries lock
each file too; this lock keeps N processes from starting N parallel snapshot downloads.

:func:`hub_error` turns the libraries' exceptions into one :class:`HubError` line that names
the id and the cause: offline mode with nothing cached, the network, a missing (or private)
repository, a gated repository, a missing revision.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator

import filelock
import huggingface_hub.constants
from huggingface_hub import errors


class HubError(FileNotFoundError):
    """A hub id could not be resolved; the message names the id and the cause."""


def offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (read by ``huggingface_hub`` at import) is set."""
    return bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def looks_like_hub_id(name: str) -> bool:
    """``"org/name"`` or ``"name"``: no path separators beyond one, no file suffix, not local."""
    return (
        not os.path.exists(name)
        and not name.startswith((".", "/", "~"))
        and name.count("/") <= 1
        and all(part for part in name.split("/"))
    )


@contextlib.contextmanager
def download_lock(kind: str, repo_id: str) -> Iterator[None]:
    """Held while one process of this host resolves ``repo_id``; the others wait here."""
    folder = os.path.join(huggingface_hub.constants.HF_HUB_CACHE, ".locks", "delta_jax")
    os.makedirs(folder, exist_ok=True)
    key = hashlib.sha256(f"{kind}:{repo_id}".encode()).hexdigest()[:16]
    with filelock.FileLock(os.path.join(folder, f"{key}.lock")):
        yield


def hub_error(kind: str, repo_id: str, revision: str | None, error: BaseException) -> HubError:
    """One-line :class:`HubError` for a failed resolution of ``repo_id`` (a model or data set)."""
    what = f"{kind} {repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    text = f"{type(error).__name__}: {error}"
    chain = [error]  # `datasets` wraps the hub's errors in its own
    while len(chain) < 16 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)

    def caused_by(kind) -> bool:
        return any(isinstance(e, kind) for e in chain)

    if caused_by(errors.GatedRepoError) or "is a gated dataset" in text:
        cause = (
            "is a gated repository: accept its terms on the hub page, then log in "
            "(`hf auth login`) or set HF_TOKEN"
        )
    elif caused_by(errors.RevisionNotFoundError):
        cause = "exists, but that revision does not"
    elif caused_by(errors.RepositoryNotFoundError) or "doesn't exist on the Hub" in text:
        cause = (
            f"was not found on the hub ({endpoint}): check the id, or set HF_TOKEN if it is private"
        )
    elif offline():
        cause = (
            "is not in the local cache and HF_HUB_OFFLINE=1 forbids downloading it: unset "
            "HF_HUB_OFFLINE (or download it once where there is network)"
        )
    else:
        cause = (
            f"is not in the local cache and the hub ({endpoint}) could not be reached: check the "
            "network (or HF_ENDPOINT)"
        )
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return HubError(f"{what} {cause} [{first_line}]")
