"""``delta-jax plan``: arguments, the CPU stand-in devices, the printed table."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

import jax
from jax._src import xla_bridge  # backends_are_initialized: no public equivalent

from delta_jax import sharding as sh
from delta_jax.config import load_config
from delta_jax.plan.compiler import resolve_compiler
from delta_jax.plan.lengths import parse_lengths
from delta_jax.plan.roofline import Workload
from delta_jax.plan.search import plan


def _ensure_devices(count: int) -> None:
    """Makes this process start JAX on CPU with ``count`` fake devices, if JAX has not started."""
    if xla_bridge.backends_are_initialized():
        return
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of ``delta-jax plan`` (added to ``parser`` when given)."""
    parser = parser or argparse.ArgumentParser(
        prog="delta-jax plan",
        description="Memory planner: will this run fit a TPU slice, and with what micro-batch?",
    )
    parser.add_argument("--config", default=None, help="YAML run config")
    parser.add_argument("--topology", required=True, help="TPU slice, e.g. v5p-64, v4-32, v5e-8")
    parser.add_argument("--headroom", type=float, default=0.95, help="usable fraction of HBM")
    parser.add_argument(
        "--no-search", action="store_true", help="skip the micro-batch and decode-slot searches"
    )
    parser.add_argument(
        "--skip-train", action="store_true", help="plan the sampler side only (no train step)"
    )
    parser.add_argument(
        "--no-roofline",
        action="store_true",
        help="skip the step-time roofline (two more train compiles, of 1 and 2 layers)",
    )
    parser.add_argument(
        "--mean-new-tokens",
        type=float,
        default=None,
        help="expected new tokens per sequence for the roofline (default rollout.max_new_tokens)",
    )
    parser.add_argument(
        "--tokens-per-step",
        type=float,
        default=None,
        help="a measured tokens per speculative verify step (speculate/tokens_per_step): the "
        "roofline also bounds the rollout with rollout.draft_tokens drafts a step",
    )
    parser.add_argument(
        "--lengths",
        default=None,
        metavar="SPEC",
        help="a response-length distribution: lognormal:mean=M,sigma=S (the mean of the lengths "
        "capped at rollout.max_new_tokens), lognormal:median=M,sigma=S, quantiles:0.5=L,0.9=L,..., "
        "list:L,L,... or a run's metrics.jsonl; the roofline also bounds the rollout at these "
        "lengths: synchronous, partial and asynchronous on split meshes (docs/planner.md)",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="policy versions a sequence may span in the asynchronous bound (>= 1; default 1)",
    )
    parser.add_argument(
        "--programs",
        action="store_true",
        help="also compile every program a run compiles (the train step at each bucket of "
        "rows, the engine's decode chunk at each slot bucket and prefill chunk at each length) "
        "and list their compile times",
    )
    parser.add_argument(
        "--compiler",
        default="auto",
        choices=("auto", "tpu", "cpu"),
        help="tpu: the TPU compiler, compile-only (needs libtpu); cpu: XLA:CPU estimate; "
        "auto: tpu when libtpu is importable",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``delta-jax plan --config FILE --topology v5p-64 [section.key=value ...]``."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Runs the planner for parsed ``args`` (see :func:`build_parser`); prints the table."""
    if not 0 < args.headroom <= 1:
        raise ValueError(f"--headroom={args.headroom} must be in (0, 1]")
    if args.tokens_per_step is not None and args.no_roofline:
        raise ValueError("--tokens-per-step bounds the rollout in the roofline: drop --no-roofline")
    if args.lengths is not None and args.no_roofline:
        raise ValueError("--lengths bounds the rollout in the roofline: drop --no-roofline")
    if args.max_staleness < 1:
        raise ValueError(f"--max-staleness={args.max_staleness} must be >= 1")
    kind, _ = resolve_compiler(args.compiler)
    # Compile-only TPU planning keeps the default backend on CPU (no TPU probing).
    _ensure_devices(sh.topology(args.topology).chips if kind == "cpu" else 1)
    config = load_config(args.config, args.overrides)
    lengths = None
    if args.lengths is not None:
        lengths = parse_lengths(args.lengths, config.rollout.max_new_tokens)
    workload = Workload(args.mean_new_tokens, args.tokens_per_step, lengths, args.max_staleness)
    workload.mean_new(config.rollout)  # checked before any compile
    report = plan(
        config,
        args.topology,
        headroom=args.headroom,
        search=not args.no_search,
        compiler=kind,
        compile_train=not args.skip_train,
        roofline=False if args.no_roofline else workload,
        programs=args.programs,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(report.table())
    return 0
