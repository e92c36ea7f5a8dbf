"""The ``delta-jax`` command: train, eval, sample, export, plot.

Kept thin: each sub-command parses its arguments and calls the library. User mistakes (bad
config keys or values, missing files, malformed data, an optional dependency the command needs
and the install lacks) end as one ``error:`` line and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from delta_jax import distributed
from delta_jax import plan as plan_lib
from delta_jax.config import ConfigError, load_config
from delta_jax.eval import add_eval_arguments, run_eval_cli
from delta_jax.extras import MissingExtra

SAMPLE_TOKENS = 256  # `delta-jax sample`'s default new tokens, where the model's context allows


def _cmd_train(args) -> int:
    # Lazy: each command imports its own modules when it runs.
    from delta_jax.rl import train

    result = train(load_config(args.config, args.overrides))
    status = "stopped by SIGTERM at" if result.stopped_early else "finished"
    print(f"\nRun {status} step {result.last_step}.")
    print(f"  metrics:     {result.metrics_path}")
    if result.plot_path is not None:
        print(f"  plot:        {result.plot_path}")
    print(f"  checkpoints: {result.checkpoint_dir}")
    print(f"  tensorboard: {result.run_dir / 'tensorboard'}")
    return 0


def _cmd_export(args) -> int:
    # Lazy: each command imports its own modules when it runs.
    from delta_jax.models import lora, save_pretrained
    from delta_jax.rl.setup import DEMO_MODEL, restore_policy

    run_dir = Path(args.run)
    model, tokenizer, step = restore_policy(run_dir, args.step)
    if args.adapters:
        if not model.config.lora_rank:
            raise ConfigError(f"{run_dir}: --adapters needs a LoRA run (model.lora_rank > 0)")
        base = load_config(run_dir / "config.yaml").model.path
        base = str(run_dir / "demo_model") if base == DEMO_MODEL else base
        lora.save_peft_adapters(model, args.out, base_model=base)
        what = "LoRA adapters (PEFT format)"
    else:
        what = "model with its LoRA adapters merged" if model.config.lora_rank else "model"
        save_pretrained(lora.merge_adapters(model), args.out, tokenizer=tokenizer)
    print(f"exported step {step} of {args.run} to {args.out}: {what}")
    return 0


def _load_model_and_tokenizer(path: str):
    # Lazy: each command imports its own modules when it runs.
    from delta_jax.models import from_pretrained, load_tokenizer

    return from_pretrained(path), load_tokenizer(path)


def _cmd_sample(args) -> int:
    # Lazy: each command imports its own modules when it runs.
    from delta_jax.models import apply_chat_template
    from delta_jax.rl.setup import special_token_ids
    from delta_jax.sampling import Sampler

    model, tokenizer = _load_model_and_tokenizer(args.model)
    text = args.prompt if args.raw else apply_chat_template(tokenizer, args.prompt)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    pad_id, stop_ids = special_token_ids(tokenizer, model)
    room = model.config.max_position_embeddings - len(prompt)
    out = Sampler(model, pad_token_id=pad_id).generate(
        [prompt],
        n=args.n,
        max_new_tokens=args.max_new_tokens or min(SAMPLE_TOKENS, max(room, 1)),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=stop_ids,
    )
    for i, tokens in enumerate(out.tokens):
        print(f"--- sample {i} ({out.lengths[i]} tokens)")
        print(tokenizer.decode(tokens, skip_special_tokens=True))
    return 0


def _cmd_plot(args) -> int:
    # Lazy: each command imports its own modules when it runs.
    from delta_jax.diagnostics import plot_delta_stats
    from delta_jax.diagnostics.plots import plot_runs

    print(plot_runs(args.runs, args.out))
    if args.delta_stats:
        print(plot_delta_stats(args.runs, args.delta_stats))
    return 0


def _cmd_compare(args) -> int:
    # Lazy: each command imports its own modules when it runs.
    from delta_jax.compare import compare

    for loss in args.losses:  # a bad key or loss is an error before any run starts
        load_config(args.config, [*args.overrides, f"algo.loss={loss}"])
    print(
        compare(
            args.config,
            args.overrides,
            args.losses,
            args.seeds,
            args.out,
            workers=args.workers,
            title=args.title,
            coefficients=not args.no_coefficients,
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="delta-jax", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run or resume an RL job")
    p.add_argument("--config", default=None, help="YAML config (default: the built-in CPU demo)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face directory")
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--adapters",
        action="store_true",
        help="LoRA runs: write only the adapters, as PEFT's adapter_model.safetensors + "
        "adapter_config.json (default: the adapters merged into a full model)",
    )
    p.set_defaults(fn=_cmd_export)

    def sampling_args(p, *, temperature, top_p, max_new_tokens):
        p.add_argument("--model", required=True, help="Hugging Face model directory")
        help = f"default: {max_new_tokens}, or what the model's context leaves after the prompt"
        p.add_argument("--max-new-tokens", type=int, default=None, help=help)
        p.add_argument("--temperature", type=float, default=temperature)
        p.add_argument("--top-p", type=float, default=top_p)
        p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("sample", help="generate from a model directory")
    sampling_args(p, temperature=1.0, top_p=1.0, max_new_tokens=SAMPLE_TOKENS)
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--top-k", type=int, default=0)
    p.set_defaults(fn=_cmd_sample)

    # Paper evaluation settings (DELTA_SPEC §7): avg@16, temperature 1.0, top-p 0.7.
    p = sub.add_parser("eval", help="avg@k / pass@k / maj@k of a model on benchmark files")
    add_eval_arguments(p)
    p.set_defaults(fn=run_eval_cli)

    p = sub.add_parser("plan", help="per-device memory of a config on a TPU topology")
    plan_lib.build_parser(p)
    p.set_defaults(fn=plan_lib.run)

    p = sub.add_parser("compare", help="seeds x losses on one config: table with intervals")
    p.add_argument("--config", required=True)
    p.add_argument("--losses", nargs="+", default=["delta", "dapo"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--out", required=True, help="sweep directory (re-run to resume)")
    p.add_argument("--workers", type=int, default=None, help="runs at once (default cores/2)")
    p.add_argument("--title", default=None)
    p.add_argument("--no-coefficients", action="store_true", help="skip DelTA statistics")
    p.add_argument("overrides", nargs="*", help="section.key=value for every run")
    p.set_defaults(fn=_cmd_compare)

    p = sub.add_parser("plot", help="learning curves of one or more runs")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="learning_curves.png")
    p.add_argument("--delta-stats", default=None, help="also write DelTA statistics to this PNG")
    p.set_defaults(fn=_cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    distributed.leave_out_absent_tpu()  # before anything starts a JAX backend
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.INFO
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S")
    logging.getLogger().setLevel(level)  # an import may have set up the root logger already
    for noisy in ("absl", "jax._src", "orbax", "httpx", "matplotlib", "PIL", "tensorboardX"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.command != "plan":  # the planner works on fake devices, never a cluster
            distributed.check_tpu_runtime()
            distributed.initialize()
        return args.fn(args)
    except (ConfigError, FileNotFoundError, ValueError, MissingExtra) as e:
        if args.verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
