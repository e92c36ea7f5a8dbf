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
# Never reach a model or dataset hub from the test-suite.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
