"""delta_jax: JAX/TPU-native RLVR training built around DelTA.

This top-level module deliberately imports nothing heavy: ``import delta_jax.losses`` must load
only jax and numpy, so sub-packages are imported explicitly by the caller.
"""

__version__ = "0.1.0"
