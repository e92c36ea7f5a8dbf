"""Hand-made train batches in the padded layout (one sequence per row), for sharding tests."""

import numpy as np

from delta_jax.rl.train_step import TrainBatch
from delta_jax.rl.update_plan import UpdatePlan


def padded_plan(loss: str, prompt: int, gen: int, rows: int, *algo: str) -> UpdatePlan:
    """The update plan of ``rows`` sequences (one update) in the padded layout."""
    return UpdatePlan.padded(loss, prompt, gen, rows, *algo)


def padded_batch(ids, attention, response, advantages) -> TrainBatch:
    """NumPy ``TrainBatch`` of left-padded prompts ``[..., P]`` ++ right-padded responses.

    Args:
      ids: int ``[M, b, P + G]``; attention: bool ``[M, b, P + G]`` real tokens;
      response: bool ``[M, b, G]``; advantages: float ``[M, b]``.
    """
    segment_ids = attention[..., :-1].astype(np.int32)
    return TrainBatch(
        tokens=np.where(segment_ids > 0, ids[..., :-1], 0).astype(np.int32),
        targets=ids[..., 1:].astype(np.int32),
        segment_ids=segment_ids,
        loss_mask=response,
        advantages=np.where(response, advantages[..., None], 0).astype(np.float32),
        rollout_logprobs=np.zeros(response.shape, np.float32),
    )
