"""Streaming rewards: a row is scored as soon as it ends (a group once its rows have, for a
batched function); the result is exactly the rewards scored after the last token (same values,
order, flips and advantages)."""

import time

import numpy as np
import pytest

from delta_jax.data import encode_prompts
from delta_jax.demo import arithmetic_records
from delta_jax.losses.advantages import grpo_advantages
from delta_jax.models import from_pretrained, load_tokenizer
from delta_jax.rewards import FlippedRewards, RewardSet
from delta_jax.rl.rollout import RolloutSpec, collect_rollout
from delta_jax.sampling import Sampler


def brevity(prompts, completions, **columns):
    """A batched reward the worker processes can import."""
    return [1.0 / (1 + len(c)) for c in completions]


class Recorded:
    """A scorer that records the size of each submission."""

    def __init__(self, scorer):
        self.scorer, self.sizes = scorer, []

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def submit(self, prompts, responses, items, **kwargs):
        self.sizes.append(len(responses))
        return self.scorer.submit(prompts, responses, items, **kwargs)


@pytest.mark.parametrize("fns", [["math", brevity], ["math"]], ids=["batched", "per_item"])
@pytest.mark.parametrize("engine", ["continuous", "static"])
def test_streamed_rewards_equal_rewards_scored_after_the_last_token(demo_model_dir, engine, fns):
    model, tok = from_pretrained(str(demo_model_dir)), load_tokenizer(str(demo_model_dir))
    records = arithmetic_records(4, seed=3)
    enc = encode_prompts(records, tok, max_prompt_length=16, template="{prompt}")
    sampler = Sampler(model, pad_token_id=0, engine=engine, decode_slots=8, decode_chunk=2)
    rewards = RewardSet(fns, [1.0, 0.5][: len(fns)], num_workers=2)
    scorer = Recorded(FlippedRewards(rewards, 0.3, seed=1))
    with rewards:
        start = time.perf_counter()
        ro = collect_rollout(
            sampler=sampler,
            params=None,
            scorer=scorer,
            tokenizer=tok,
            prompt_batches=iter([list(zip(enc.ids, enc.records, strict=True))]),
            spec=RolloutSpec(
                n=4,
                prompt_len=16,
                gen_len=24,
                sampling=dict(
                    temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=(tok.eos_token_id,)
                ),
                advantage="grpo",
                overlong=None,
                dynamic_rounds=0,
                return_hidden=False,
            ),
            seed=5,
        )
        wall = time.perf_counter() - start
        items = [{"answer": r.answer, "tests": r.tests, **r.extra} for r in ro.records]
        want = scorer.score([r.prompt for r in ro.records], ro.responses, items, group_size=4)
    assert len(set(ro.lengths.tolist())) > 1  # ragged: rows end at different steps
    unit = 4 if brevity in fns else 1  # one submission per row, per group if a function is batched
    assert scorer.sizes == [unit] * (16 // unit)
    np.testing.assert_array_equal(ro.rewards, want.rewards)
    np.testing.assert_array_equal(ro.advantages, np.asarray(grpo_advantages(want.rewards, 4)))
    for name, values in want.components.items():
        assert ro.stats[f"reward/{name}"] == pytest.approx(float(np.mean(values)))
    assert ro.stats["reward_reason/flipped"] == want.counts["flipped"]
    # The sampler call, then the wait for the rewards still out after its last token: two
    # parts of the call, one after the other.
    tail, sampling = ro.stats["time/reward_tail"], ro.stats["time/rollout"]
    assert 0 < tail and 0 < sampling and sampling + tail <= wall
