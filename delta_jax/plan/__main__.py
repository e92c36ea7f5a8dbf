"""``python -m delta_jax.plan``: the same as ``delta-jax plan``."""

import sys

from delta_jax.plan.cli import main

sys.exit(main())
