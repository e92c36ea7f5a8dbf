"""Math reward scoring throughput: the process pool against serial in-process scoring.

Builds N synthetic responses (reasoning filler of a given length, then a final ``\\boxed{}``)
over a mix of answer kinds — integers, fractions vs decimals, ``\\dfrac``, radicals,
polynomials, intervals, sets, units — half of them correct, and scores them

* serially in this process (``RewardScorer(num_workers=0)``: math-verify in a loop), and
* with ``RewardScorer(num_workers=W)`` (workers started and warmed up before timing; their
  start-up time is printed separately),

printing responses/s for each and the rewards' agreement. ``--hangs K`` replaces K responses
with a verifier-hanging ``\\boxed{9^{9^{9^{9}}}}`` (pool only: serially it would never return),
which shows what the per-item deadline costs.

    python benchmarks/reward_throughput.py                      # N=1024, one worker per CPU
    python benchmarks/reward_throughput.py --num-responses 256 --workers 4 --hangs 2
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np

from delta_jax.rewards import RewardScorer

# (gold answer, a correct way to write it, a wrong one)
_ANSWERS = [
    ("12", "12", "13"),
    (r"\frac{1}{2}", "0.5", "0.25"),
    ("0.75", r"\dfrac{3}{4}", r"\frac{4}{3}"),
    (r"\sqrt{2}", r"2^{1/2}", "1.41"),
    (r"2\pi", r"2 \pi", r"\pi"),
    ("x^2 + 2x + 1", "(x+1)^2", "(x-1)^2"),
    ("(1, 2]", "(1,2]", "[1,2]"),
    (r"\{1, 2, 3\}", r"\{3, 2, 1\}", r"\{1, 2\}"),
    ("5", r"5\text{ cm}", r"6\text{ cm}"),
    ("-3", "x = -3", "x = 3"),
]
_FILLER = "We compute the quantity step by step, simplifying where possible. "


def make_batch(n: int, response_chars: int, seed: int) -> tuple[list[str], list[dict], np.ndarray]:
    """N responses, their items and the expected rewards (from the table above)."""
    rng = random.Random(seed)
    filler = (_FILLER * (response_chars // len(_FILLER) + 1))[:response_chars]
    responses, items, expected = [], [], []
    for _ in range(n):
        gold, right, wrong = rng.choice(_ANSWERS)
        correct = rng.random() < 0.5
        responses.append(
            f"{filler}\nTherefore the answer is \\boxed{{{right if correct else wrong}}}."
        )
        items.append({"answer": gold})
        expected.append(float(correct))
    return responses, items, np.array(expected, np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-responses", type=int, default=1024, help="N")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="W")
    parser.add_argument("--response-chars", type=int, default=2000, help="filler per response")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="per-item deadline (pool)")
    parser.add_argument("--hangs", type=int, default=0, help="hanging responses (pool only)")
    parser.add_argument("--skip-serial", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    responses, items, expected = make_batch(args.num_responses, args.response_chars, args.seed)
    prompts = ["Solve the problem."] * args.num_responses
    print(
        f"N={args.num_responses} responses of ~{args.response_chars} chars, cpus={os.cpu_count()}"
    )

    if not args.skip_serial:
        serial = RewardScorer("math", num_workers=0)
        serial.score(prompts[:1], [r"\boxed{1}"], [{"answer": "1"}])  # Builds the grammar.
        start = time.perf_counter()
        batch = serial.score(prompts, responses, items)
        elapsed = time.perf_counter() - start
        agree = np.mean(batch.rewards == expected)
        print(
            f"serial      : {elapsed:7.2f} s  {args.num_responses / elapsed:8.1f} responses/s"
            f"  agreement with expected {agree:.3f}"
        )

    pool_responses = list(responses)
    for i in range(args.hangs):
        pool_responses[i * len(responses) // max(args.hangs, 1)] = r"\boxed{9^{9^{9^{9}}}}"
    start = time.perf_counter()
    with RewardScorer("math", num_workers=args.workers, timeout_s=args.timeout_s) as pool:
        pool.wait_ready()
        print(f"pool start-up ({args.workers} workers): {time.perf_counter() - start:.2f} s")
        start = time.perf_counter()
        batch = pool.score(prompts, pool_responses, items)
        elapsed = time.perf_counter() - start
    agree = np.mean(batch.rewards == expected)
    print(
        f"pool (W={args.workers}) : {elapsed:7.2f} s  {args.num_responses / elapsed:8.1f} "
        f"responses/s  agreement with expected {agree:.3f}  counts {batch.counts}"
    )


if __name__ == "__main__":
    main()
