"""The update's row-wide window against the window of each step's fullest row: its cost.

``configs/smollm2_arith.yaml``'s update (SmolLM2-135M's shapes, random weights: ``bench_models``
``smollm2``; 6 prompts x 8 samples, prompts of ``--prompt`` tokens, responses uniform in
``[--min-response, --max-response]``; DelTA's coefficients in the loss; AdamW), the rows built
by the trainer's own stages (``plan_rows`` + ``assemble``), with prompts shared and not
(``--share-prompts``: ``algo.share_prompts`` false and true):

* **row-wide** (what the trainer runs): a window of as many slots as a row has positions, the
  LM head's chunks of slots that no row uses skipped: one width whatever the lengths (at each
  of ``--slot-chunks`` chunks per window; the trainer's is ``models.logprobs.SLOT_CHUNKS``);
* **bucketed**: the same batch, its window cut to the old bucket of its fullest row (a
  multiple of about a sixteenth of a row, two per power of two: what each step compiled
  before, one program per new width), the LM head in one chunk as before.

The programs are compiled first (compile times and XLA's temporaries printed: what a new width
cost before), then the calls alternate, the median of ``--repeats`` each.

``--rollout``: the rollout's request (the same prompts, 8 samples each, token budgets as the
responses' lengths, no stop ids, temperature 0.7, the continuous engine's defaults on this
CPU) from a sampler whose prompt and response buckets are the run's longest (192, 32: one
request shape whatever the prompts) against powers of two of the request's own (the default
the trainer keeps), warmed up once each, then alternating, the median of ``--repeats`` each.

    python benchmarks/compile_once.py [--repeats 5] [--slot-chunks 1 4 16] [--rollout]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_models import alternate, bench_config
from flax import nnx

from delta_jax.config import load_config
from delta_jax.models import Transformer, logprobs
from delta_jax.rl.packing import make_assemble, plan_rows
from delta_jax.rl.state import init_train_state, make_optimizer
from delta_jax.rl.train_step import make_train_step
from delta_jax.rl.update_plan import UpdatePlan
from delta_jax.sampling import Buckets, Sampler

PROMPTS, N, P_MAX, G_MAX = 6, 8, 192, 32  # configs/smollm2_arith.yaml
WIDE = ("targets", "loss_mask", "advantages", "rollout_logprobs", "score_positions")
WIDE += ("score_segments",)


def old_width(row_len: int, responses: int) -> int:
    """The window the update compiled before: a multiple of about a sixteenth of a row, two
    sizes per power of two, at most the row."""
    unit = 8 * -(-row_len // 128)
    units = -(-max(responses, 1) // unit)
    power = 1 << (units - 1).bit_length()
    size = 3 * power // 4 if power >= 4 and units <= 3 * power // 4 else power
    return min(unit * size, row_len)


def rollout_arrays(config, rng, args):
    """A synthetic rollout batch: device arrays and its host lengths."""
    B = PROMPTS * N
    plens = np.full(B, args.prompt, np.int32)
    glens = rng.integers(args.min_response, args.max_response + 1, B).astype(np.int32)
    seqs = np.zeros((B, P_MAX + G_MAX), np.int32)
    for i in range(B):
        if i % N == 0:
            prompt = rng.integers(3, config.vocab_size, args.prompt)
        seqs[i, P_MAX - args.prompt : P_MAX] = prompt
        seqs[i, P_MAX : P_MAX + glens[i]] = rng.integers(3, config.vocab_size, glens[i])
    arrays = (
        jnp.asarray(seqs),
        jnp.asarray(-rng.uniform(size=(B, G_MAX)).astype(np.float32)),
        jnp.asarray(rng.normal(size=B).astype(np.float32)),
    )
    return arrays, plens, glens


def cut(batch, width: int):
    """The batch with its window cut to ``width`` slots (every live slot comes first)."""
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    narrow = lambda k, v: v[..., :width] if k in WIDE else v
    return type(batch)(**{k: None if v is None else narrow(k, v) for k, v in fields.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=54)
    parser.add_argument("--min-response", type=int, default=6)
    parser.add_argument("--max-response", type=int, default=22)
    parser.add_argument("--rollout", action="store_true", help="the rollout's buckets instead")
    parser.add_argument(
        "--slot-chunks", type=int, nargs="+", default=[4], help="LM-head chunks per window"
    )
    parser.add_argument("--share-prompts", nargs="+", default=["false", "true"])
    args = parser.parse_args()
    if args.rollout:
        return rollout(args)
    config = bench_config("smollm2")
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    arrays, plens, glens = rollout_arrays(config, np.random.default_rng(0), args)
    print(
        f"smollm2 shapes, {PROMPTS} prompts x {N} samples, prompt {args.prompt} tokens, "
        f"responses mean {glens.mean():.1f} (max {glens.max()})",
        flush=True,
    )
    for share in args.share_prompts:
        cfg = load_config("configs/smollm2_arith.yaml", [f"algo.share_prompts={share}"])
        plan = UpdatePlan.from_config(cfg)
        optimizer = make_optimizer(cfg.optim, 10)
        index, stats = plan_rows(plan, np.arange(PROMPTS * N), plens, glens, 1)
        batch = jax.tree.map(lambda x: x[0], make_assemble(plan)(*arrays, None, None, index))
        used = int(np.asarray(batch.score_positions >= 0).sum(-1).max())
        width = old_width(plan.row_len, used)
        shapes = {f"row-wide/{k}": (batch, k) for k in args.slot_chunks}
        shapes["bucketed"] = (cut(batch, width), 1)
        state = init_train_state(params, optimizer)
        programs = {}
        for name, (b, chunks) in shapes.items():
            t0 = time.perf_counter()
            logprobs.SLOT_CHUNKS = chunks  # read when the step is traced
            step = make_train_step(graphdef, optimizer, plan, donate=False)
            step = step.lower(state, b).compile()
            print(
                f"shared={share} {name}: {b.tokens.shape[1]} rows x {plan.row_len}, window "
                f"{b.targets.shape[-1]} (fullest row {used}); compiled in "
                f"{time.perf_counter() - t0:.1f} s, temporaries "
                f"{step.memory_analysis().temp_size_in_bytes / 2**30:.2f} GiB",
                flush=True,
            )
            programs[name] = functools.partial(step, state, b)
        medians = alternate(programs, args.repeats)
        for name, median in medians.items():
            ratio = median / medians["bucketed"]
            print(f"shared={share} update {name}: {median:.2f} s, {ratio:.3f}x the bucketed")
        loss = {k: float(v()[1]["loss"]) for k, v in programs.items()}
        print(f"shared={share} losses: {loss}", flush=True)


def rollout(args) -> None:
    """The rollout's request from both samplers (see the module)."""
    config = bench_config("smollm2")
    model = Transformer(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, args.prompt).tolist() for _ in range(PROMPTS)]
    budgets = rng.integers(args.min_response, args.max_response + 1, PROMPTS * N)
    budgets[0] = G_MAX  # the run's longest response: the engine sizes its pages for it
    limit = config.max_position_embeddings
    beyond = lambda n: (n, *(2**k for k in range(n.bit_length(), 64) if 2**k <= limit))
    samplers = {"run lengths": Buckets(beyond(P_MAX), beyond(G_MAX)), "powers of two": Buckets()}
    calls = {}
    for name, buckets in samplers.items():
        sampler = Sampler(model, engine="continuous", decode_slots=64, buckets=buckets)
        settings = dict(n=N, max_new_tokens=budgets.tolist(), temperature=0.7, seed=0)
        request = functools.partial(sampler.generate, prompts, stop_token_ids=(), **settings)
        t0 = time.perf_counter()
        request()
        print(f"{name}: first request (compiles) {time.perf_counter() - t0:.1f} s", flush=True)
        calls[name] = request
    medians = alternate(calls, args.repeats)
    fixed, powers = medians["run lengths"], medians["powers of two"]
    print(f"rollout request: run lengths {fixed:.2f} s, powers of two {powers:.2f} s")
    print(f"run lengths / powers of two: {fixed / powers:.3f}x", flush=True)


if __name__ == "__main__":
    main()
