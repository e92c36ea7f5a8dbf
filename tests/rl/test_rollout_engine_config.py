"""The rollout engine config keys reach the trainer's sampler."""

import pytest

from delta_jax import Trainer
from delta_jax.config import ConfigError, load_config
from tests.rl.conftest import tiny_overrides
from tests.rl.test_loop import DEMO


def test_engine_keys_are_wired(tmp_path, demo_model_dir):
    with Trainer(load_config(DEMO, tiny_overrides(tmp_path / "a", demo_model_dir))) as default:
        assert default.sampler.engine == "continuous"
        assert default.sampler.num_pages is None  # sized by the engine
    extra = (
        "rollout.engine=static",
        "rollout.decode_slots=8",
        "rollout.page_size=32",
        "rollout.num_pages=40",
    )
    with Trainer(load_config(DEMO, tiny_overrides(tmp_path / "b", demo_model_dir, *extra))) as t:
        s = t.sampler
    assert (s.engine, s.decode_slots, s.page_size, s.num_pages) == ("static", 8, 32, 40)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.decode_slots=0", "rollout.decode_slots=0 must be >= 1"),
        ("rollout.page_size=0", "rollout.page_size=0 must be >= 1"),
        ("rollout.decode_slots=4", "samples_per_prompt=8 exceeds rollout.decode_slots=4"),
        ("rollout.engine=paged", "rollout.engine"),
        ("rollout.num_pages=-1", "rollout.num_pages=-1 must be >= 0"),
    ],
)
def test_engine_keys_are_validated(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, [override])
