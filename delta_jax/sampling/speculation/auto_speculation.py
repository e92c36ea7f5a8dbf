"""``speculate="auto"``: whether a sampler's next request decodes with verify steps or without.

Speculation changes which steps produce the tokens, never the tokens, so the choice is about
time alone. A verify step scores ``k + 1`` positions per sequence for one read of the weights:

* where the decode is compute-bound, it costs about ``k + 1`` decode steps' arithmetic and
  gains only where more than that many tokens come per verify step. That is the CPU: there
  ``auto`` never speculates (on this repository's 2-core CPU, SmolLM2-135M's step-by-step
  rollouts ran at 0.84x / 0.84x / 0.54x the speed of plain decoding at batch 1 / 8 / 32, with
  1.43-1.64 tokens per verify step, ``benchmarks/speculative.py``);
* where it is bound by reading the weights (TPU and GPU at RL's batch sizes: the planner's
  roofline puts the paper config's decode at 1.05x the minimum bytes per token), a verify step
  costs little more than a decode step (an H100: 1.04x at batch 1, 1.40-1.46x at 64,
  ``benchmarks/verify_cost.py``), and speculation gains whenever the drafts are accepted often
  enough, which depends on the task and drifts as the policy trains.

So on accelerators both ways are measured in the run: each request's seconds per generated
token, per way, a running mean over the recent requests (a way's first request compiles and is
not counted). The first requests try each way twice; after that the faster one runs, and the
other runs again every ``probe_every`` requests so that a change (acceptance rising as the
policy settles, or falling after an update) is seen.
"""

from __future__ import annotations

import dataclasses

__all__ = ["AutoSpeculation"]


@dataclasses.dataclass
class AutoSpeculation:
    """The ``auto`` policy of one sampler (see the module docstring).

    Args:
      platform: the sampling devices' platform (``"cpu"``: never speculate).
      probe_every: how often the way that is not the faster one runs again, in requests.
      smoothing: weight of a request's figure in the running mean of its way.

    Examples:
      >>> auto = AutoSpeculation("gpu")
      >>> auto.next()  # its first request tries speculation
      True
      >>> AutoSpeculation("cpu").next()
      False
    """

    platform: str
    probe_every: int = 8
    smoothing: float = 0.5
    runs: dict[bool, int] = dataclasses.field(default_factory=lambda: {True: 0, False: 0})
    seconds_per_token: dict[bool, float | None] = dataclasses.field(
        default_factory=lambda: {True: None, False: None}
    )
    since_probe: int = 0

    def next(self) -> bool:
        """Whether the next request speculates."""
        if self.platform == "cpu":
            return False
        for way in (True, False):  # each way twice: its compile, then a measured request
            if self.runs[way] < 2:
                return way
        best = self.faster()
        self.since_probe += 1
        if self.since_probe >= self.probe_every:
            self.since_probe = 0
            return not best
        return best

    def faster(self) -> bool:
        """The way with the fewer seconds per token so far (speculation on a tie)."""
        spec, plain = self.seconds_per_token[True], self.seconds_per_token[False]
        if spec is None or plain is None:
            return spec is not None or plain is None
        return spec <= plain

    def record(self, speculative: bool, seconds: float, tokens: int) -> None:
        """A request that took ``seconds`` for ``tokens`` generated tokens."""
        self.runs[speculative] += 1
        if self.runs[speculative] == 1 or tokens <= 0:
            return  # the way's first request compiles its programs
        now, mean = seconds / tokens, self.seconds_per_token[speculative]
        a = self.smoothing
        self.seconds_per_token[speculative] = now if mean is None else a * now + (1 - a) * mean
