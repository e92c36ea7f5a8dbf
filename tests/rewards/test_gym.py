"""The ``reasoning_gym`` reward kind, through the real RewardSet / RewardScorer."""

import pickle
import sys

import pytest

from delta_jax.config import ConfigError, load_config
from delta_jax.data.gym import gym_records
from delta_jax.rewards import RewardScorer, RewardSet, extract_gym_answer
from delta_jax.rewards.gym import ANSWER_MARKER, GYM_ENTRY, MIN_WORKING, marked_answer, score_gym
from delta_jax.rl.setup import make_scorers

RECORDS = gym_records("basic_arithmetic", size=3, seed=0) + gym_records(
    "leg_counting", size=1, seed=0
)
ITEMS = [{"answer": r.answer, "tests": r.tests, **r.extra} for r in RECORDS]
A, B, C, LEGS = (r.answer for r in RECORDS)


@pytest.mark.parametrize(
    "response, answer",
    [
        ("  42 \n", "42"),
        ("Working: 6 * 7\n\n42\n\n", "42"),
        ("<answer>1</answer> then <answer>\n 42 \n</answer> done", "42"),
        ("<think>a\nb</think><answer>x\n42\n</answer>", "42"),
        ("<answer>unclosed 42", "<answer>unclosed 42"),
        ("", ""),
    ],
)
def test_the_answer_is_the_last_tag_else_the_last_line(response, answer):
    assert extract_gym_answer(response) == answer


@pytest.mark.parametrize(
    "response, answer",
    [
        ("21 - 62 = -41", "-41"),
        ("The final answer is 1,234.", "1234"),
        ("<answer>x = 7</answer> and 9 more", "7"),
        ("5-3=2\n", "2"),
        ("no number at all", "no number at all"),
    ],
)
def test_a_numeric_answer_is_the_last_number(response, answer):
    assert extract_gym_answer(response, expected="-3") == answer
    assert extract_gym_answer("It is 12.\nDone", expected="word") == "Done"


@pytest.mark.parametrize("num_workers", [0, 1])
def test_scores_by_the_task_of_each_entry(num_workers):
    responses = [f"1 + 1 = {A}", f"I think\n<answer>{B}</answer>\n", "nope", f"{LEGS}0"]
    with RewardSet("reasoning_gym", num_workers=num_workers, timeout_s=30) as rewards:
        batch = rewards.score([r.prompt for r in RECORDS], responses, ITEMS)
    assert batch.reasons == ["correct", "correct", "wrong", "partial"]
    assert batch.rewards[:3].tolist() == [1.0, 1.0, 0.0]
    assert 0 < batch.rewards[3] < 1  # leg_counting: the answer inside a longer one
    assert batch.components["reasoning_gym"].tolist() == batch.rewards.tolist()
    assert pickle.loads(pickle.dumps(ITEMS)) == ITEMS  # what the workers receive


@pytest.mark.parametrize("num_workers", [0, 1])
def test_an_answer_marker_is_required_and_only_its_line_is_read(num_workers):
    marked = {**ITEMS[0], ANSWER_MARKER: "The final answer is"}
    responses = [
        f"2 + 2 = 4, so\nThe final answer is {A}.\nCheck: 1 + 1 = 2",  # its line only
        f"the final answer is 9999, no:\nTHE FINAL ANSWER IS {A}",  # the last one, any case
        f"{A}",  # right, but not marked
        f"{A} is what I get. The final answer is unknown",
    ]
    with RewardSet("reasoning_gym", num_workers=num_workers, timeout_s=30) as rewards:
        batch = rewards.score(["p"] * 4, responses, [marked] * 4)
    assert batch.reasons == ["correct", "correct", "no_marker", "wrong"]
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert marked_answer("a\nThe final answer is 7.\nb", "final ANSWER is") == " 7."


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_working_minimum_counts_the_words_before_the_last_marker(num_workers):
    marked = {**ITEMS[0], ANSWER_MARKER: "The final answer is", MIN_WORKING: 4}
    responses = [
        f"one two three four\nThe final answer is {A}.",  # four words of working: read
        f"one two three The final answer is {A}",  # three: too few
        f"The final answer is 1. so two three four the final answer is {A}",  # before the last
        f"one two three four five {A}",  # no marker
        "one two three four. The final answer is 1",  # working, wrong answer
    ]
    with RewardSet("reasoning_gym", num_workers=num_workers, timeout_s=30) as rewards:
        batch = rewards.score(["p"] * 5, responses, [marked] * 5)
    assert batch.reasons == ["correct", "no_working", "correct", "no_marker", "wrong"]
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="min_working_words=4 needs an answer marker"):
        score_gym(A, ITEMS[0][GYM_ENTRY], None, 4)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_missing_entry_is_an_error(num_workers):
    with RewardScorer("reasoning_gym", num_workers=num_workers, timeout_s=30) as scorer:
        batch = scorer.score(["p", "p"], [A, A], [ITEMS[0], {**ITEMS[0], GYM_ENTRY: None}])
        assert batch.reasons == ["correct", "error:ValueError"]
        assert batch.rewards.tolist() == [1.0, 0.0]
        with pytest.raises(ValueError, match="items\\[0\\] must be a mapping with key 'gym_entry'"):
            scorer.submit(["p"], [A], [{"answer": A, "tests": None}])


def test_a_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails
    with pytest.raises(ImportError, match=r'needs reasoning_gym, .*: pip install -e ".*\[gym\]"$'):
        RewardScorer("reasoning_gym", num_workers=0)
    config = load_config(None, ["reward.kind=reasoning_gym", "reward.num_workers=0"])
    with pytest.raises(
        ConfigError, match=r"^reward: .* needs reasoning_gym, which is not installed"
    ):
        make_scorers(config)
