"""Host memory of RL steps, phase by phase: peak resident memory (RSS) while each phase runs, RSS
and the bytes of live JAX arrays after it, for a config's first steps on this machine.

    python benchmarks/cpu_memory.py --config configs/smollm2_arith.yaml --steps 2 \
        run.eval_every=0 data.extra_eval_sources=null   # evaluations off

Phases: building the trainer, evaluation (when ``run.eval_every`` > 0), rollout (sampling and
rewards), prepare (the batch of the update) and update (the jitted train step). RSS is sampled
every 0.1 s from ``/proc/self/statm``; the live arrays are ``jax.live_arrays()``. What the process
holds beyond its live arrays is the compiled programs, the runtime and the allocator's free
memory, which XLA:CPU's allocator keeps after a program's temporaries are freed. Linux only.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import jax

from delta_jax import Trainer
from delta_jax.config import load_config


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def live_gb() -> float:
    return sum(a.nbytes for a in jax.live_arrays()) / 1e9


class PhasePeaks:
    """Peak RSS per named phase, from a sampling thread."""

    def __init__(self):
        self.phase, self.peaks = "build", {}
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), rss_gb())
            time.sleep(0.1)

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            self.phase = label
            out = inner(*args, **kwargs)
            self.peaks[label] = max(self.peaks.get(label, 0.0), rss_gb())
            print(f"{label:>8}: peak RSS {self.peaks[label]:6.2f} GB | after: RSS {rss_gb():6.2f}"
                  f" GB, live arrays {live_gb():5.2f} GB", flush=True)  # fmt: skip
            self.phase = "between"
            return out

        setattr(obj, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2_arith.yaml")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args()
    peaks = PhasePeaks()
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"run.dir={run_dir}", f"run.steps={args.steps}", "run.save_every=0",
                     *args.overrides]  # fmt: skip
        trainer = Trainer(load_config(args.config, overrides))
        print(f"   build: peak RSS {peaks.peaks['build']:6.2f} GB | after: RSS {rss_gb():6.2f} GB,"
              f" live arrays {live_gb():5.2f} GB", flush=True)  # fmt: skip
        peaks.wrap(trainer.parts, "evaluate", "eval")
        peaks.wrap(trainer, "_rollout", "rollout")
        peaks.wrap(trainer.updater, "prepare", "prepare")
        peaks.wrap(trainer.updater, "update", "update")
        with trainer:
            for _ in range(args.steps):
                trainer.step()
    top = max(peaks.peaks.items(), key=lambda kv: kv[1])
    print(f"peak RSS {top[1]:.2f} GB, in {top[0]}; overrides: {' '.join(args.overrides) or '-'}")


if __name__ == "__main__":
    main()
