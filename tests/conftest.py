"""Test-session setup shared by every test.

Eight fake CPU devices are created before JAX initialises so that sharded code paths (meshes,
shard_map, per-shard statistics) are exercised on a plain CPU machine. Single-device code simply
runs on device 0.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
# The compile-only TPU tests load libtpu, which by default takes a machine-wide lock: another
# JAX process on the machine (a demo run, a second test session) would make them fail.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Never reach a model or dataset hub from the test-suite.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
