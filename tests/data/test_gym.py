"""reasoning-gym as a data source: records, options, held-out seeds, objects, config errors."""

import dataclasses
import sys

import pytest
import reasoning_gym
import yaml

from delta_jax import config as config_module
from delta_jax.config import Config, ConfigError, DataConfigSection, load_config
from delta_jax.data import gym
from delta_jax.data.objects import is_stream, records_from_object
from delta_jax.data.prompt_sets import IndexedPrompts
from delta_jax.demo import build_char_tokenizer
from delta_jax.rewards.gym import ANSWER_MARKER, GYM_ENTRY, MIN_WORKING
from delta_jax.rl.setup import check_gym_entries, prompt_sets

TASK = "basic_arithmetic"
SOURCE = f"data.source=reasoning_gym:{TASK}"
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _config(*overrides):
    base = [
        "data.max_prompt_length=64",
        "data.truncation=left",
        "rollout.prompts_per_step=4",
        "run.eval_prompts=8",
    ]
    return load_config(None, [*base, *overrides])


def test_records_are_a_function_of_the_seed():
    a, again = (gym.gym_records(TASK, size=5, seed=3) for _ in range(2))
    other = gym.gym_records(TASK, size=5, seed=4)
    assert a == again and [r.extra for r in a] == [r.extra for r in again]
    assert [r.prompt for r in a] != [r.prompt for r in other]
    entry = a[2].extra[GYM_ENTRY]
    assert (a[2].prompt, a[2].answer) == (entry["question"], entry["answer"])
    assert (a[2].source, a[2].row) == (f"reasoning_gym:{TASK}[seed=3]", 2)
    assert entry == reasoning_gym.create_dataset(TASK, size=5, seed=3)[2]
    assert gym.GYM_ENTRY == GYM_ENTRY and gym.MAX_SIZE < gym.EVAL_SEED_OFFSET
    assert config_module.GYM_PREFIX == gym.GYM_PREFIX
    assert config_module.field_range("data.gym_size")[1] == gym.MAX_SIZE


def test_options_are_applied():
    records = gym.gym_records(TASK, size=20, seed=0, options=SMALL)
    for r in records:
        meta = r.extra[GYM_ENTRY]["metadata"]
        assert (meta["num_terms"], meta["num_digits"]) == (2, 1)
        assert not set("*/") & set(meta["expression"])


@pytest.mark.parametrize(
    "task, options, match",
    [
        ("basic_arithmetc", {}, "unknown reasoning_gym task 'basic_arithmetc'; did you mean "
         "basic_arithmetic"),
        ("zzzz", {}, r"unknown reasoning_gym task 'zzzz'; see reasoning_gym.factory.DATASETS"),
        (TASK, {"min_term": 2}, "task 'basic_arithmetic' has no option 'min_term'; valid: "
         "min_terms, max_terms"),
        (TASK, {"seed": 1}, "'seed' is not an option here"),
        (TASK, {"min_terms": 5, "max_terms": 2}, "bad options .*AssertionError: max_terms must "
         "be >= min_terms"),
        (TASK, {"min_terms": "two"}, "bad options .*TypeError"),
    ],
)  # fmt: skip
def test_bad_tasks_and_options_are_one_line(task, options, match):
    with pytest.raises(ValueError, match=match) as info:
        gym.gym_records(task, size=2, seed=0, options=options)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=match) as info:
        load_config(None, [f"data.source=reasoning_gym:{task}", f"data.gym_options={options}"])
    assert "\n" not in str(info.value) and str(info.value).startswith("data.source=")


def test_a_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails
    with pytest.raises(ImportError, match=r'needs reasoning_gym, .*: pip install -e ".*\[gym\]"$'):
        gym.gym_records(TASK, size=2, seed=0)
    with pytest.raises(ConfigError, match=r'^data.source=.*: pip install -e ".*\[gym\]"$'):
        load_config(None, [SOURCE])


def test_train_and_held_out_sets_from_the_config(tok):
    config = _config(SOURCE, "data.gym_size=32", f"data.gym_options={SMALL}", "run.seed=5")
    train, evals = prompt_sets(config, tok)
    assert isinstance(train, IndexedPrompts) and len(train.records) == 32
    assert train.records == gym.gym_records(TASK, size=32, seed=5, options=SMALL)
    # The held-out set: eval_prompts entries of the same task and options, a disjoint seed.
    seed = 5 + gym.EVAL_SEED_OFFSET
    assert evals.records == gym.gym_records(TASK, size=8, seed=seed, options=SMALL)
    assert evals.records[0].source == f"reasoning_gym:{TASK}[seed={seed}]"
    # gym_seed replaces run.seed for both; limit caps both.
    train, evals = prompt_sets(_config(SOURCE, "data.gym_seed=7", "data.limit=6"), tok)
    assert train.records == gym.gym_records(TASK, size=6, seed=7)
    assert evals.records == gym.gym_records(TASK, size=6, seed=7 + gym.EVAL_SEED_OFFSET)


def test_an_answer_marker_reaches_every_gym_record_s_item(tok):
    marker = "data.answer_marker=The final answer is"
    config = _config(SOURCE, "reward.kind=reasoning_gym", marker, "data.gym_size=4")
    train, evals = prompt_sets(config, tok)
    seed = gym.EVAL_SEED_OFFSET
    expected = (gym.gym_records(TASK, size=4, seed=0), gym.gym_records(TASK, size=8, seed=seed))
    for records, want in zip((train.records, evals.records), expected, strict=True):
        assert {r.extra[ANSWER_MARKER] for r in records} == {"The final answer is"}
        plain = [dataclasses.replace(r, extra={GYM_ENTRY: r.extra[GYM_ENTRY]}) for r in records]
        assert plain == want
    assert gym.ANSWER_MARKER == ANSWER_MARKER


def test_a_working_minimum_reaches_every_gym_record_s_item(tok):
    marker = ["data.answer_marker=The final answer is", "data.min_working_words=30"]
    config = _config(SOURCE, "reward.kind=reasoning_gym", *marker, "data.gym_size=4")
    for records in (s.records for s in prompt_sets(config, tok)):
        assert {r.extra[MIN_WORKING] for r in records} == {30}
    assert gym.MIN_WORKING == MIN_WORKING


def test_eval_source_of_another_task_uses_its_defaults(tok):
    same = _config(SOURCE, f"data.eval_source=reasoning_gym:{TASK}", f"data.gym_options={SMALL}")
    assert prompt_sets(same, tok)[1].records == gym.gym_records(
        TASK, size=8, seed=gym.EVAL_SEED_OFFSET, options=SMALL
    )
    other = _config(SOURCE, "data.eval_source=reasoning_gym:chain_sum", "data.gym_options={}")
    assert prompt_sets(other, tok)[1].records == gym.gym_records(
        "chain_sum", size=8, seed=gym.EVAL_SEED_OFFSET
    )
    # A held-out gym task next to a file (or demo) source: the defaults, gym_seed read.
    demo = _config("data.eval_source=reasoning_gym:chain_sum", "data.gym_seed=2")
    assert prompt_sets(demo, tok)[1].records == gym.gym_records(
        "chain_sum", size=8, seed=2 + gym.EVAL_SEED_OFFSET
    )
    with pytest.raises(ConfigError, match="data.eval_source=reasoning_gym:chain_sm: .*chain_sum"):
        _config(SOURCE, "data.eval_source=reasoning_gym:chain_sm")


def test_a_procedural_dataset_object_is_map_style_with_exact_resume(tok):
    data = reasoning_gym.create_dataset(TASK, size=12, seed=1)
    assert not is_stream(data)
    result = records_from_object(data, limit=5)
    assert [r.extra[GYM_ENTRY] for r in result.records] == [data[i] for i in range(5)]
    assert result.records[3].source == "train_dataset" and result.records[3].row == 3
    held_out = reasoning_gym.create_dataset("chain_sum", size=20, seed=2)
    train, evals = prompt_sets(_config(), tok, train_dataset=data, eval_dataset=held_out)
    assert isinstance(train, IndexedPrompts) and len(train.records) == 12
    assert [r.extra[GYM_ENTRY] for r in evals.records] == [held_out[i] for i in range(8)]
    next(train)
    state = train.get_state()
    want = [next(train) for _ in range(3)]
    train.set_state(state)
    assert [next(train) for _ in range(3)] == want
    check_gym_entries(["reasoning_gym"], train, evals)
    with pytest.raises(ValueError, match="entry 1 is not a reasoning_gym entry"):
        gym.records_from_gym_dataset(_FakeGym([data[0], {"q": 1}]))


class _FakeGym(list):
    def score_answer(self, answer, entry):
        return 0.0


def test_the_reward_refuses_prompts_without_entries(tok):
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)]
    train, evals = prompt_sets(_config(), tok, train_dataset=rows, eval_dataset=rows)
    with pytest.raises(ConfigError, match="reasoning-gym prompts, but the training prompts"):
        check_gym_entries("reasoning_gym", train, evals)
    check_gym_entries(["math"], train, evals)


def test_gym_options_is_a_copied_mapping_and_the_config_still_hashes(tmp_path):
    options = {"operators": ["+", "-"], "min_terms": 2}
    config = load_config(None, [SOURCE, f"data.gym_options={options}"])
    options["operators"].append("*")
    assert config.data.gym_options == {"operators": ["+", "-"], "min_terms": 2}
    assert hash(config) == hash(dataclasses.replace(config))
    assert DataConfigSection().gym_options == {}
    assert DataConfigSection().gym_options is not DataConfigSection().gym_options
    assert Config() == Config(data=DataConfigSection(gym_options={}))
    # A config file, and the run's config.yaml written back, read the same.
    path = tmp_path / "gym.yaml"
    path.write_text(yaml.safe_dump({"data": config.to_dict()["data"]}))
    assert load_config(path) == config


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["data.gym_options={min_terms: 2}"], "data.gym_options=.* is read only with a "
         "reasoning_gym:<task> data.source"),
        (["data.gym_size=10"], "data.gym_size=10 is read only with"),
        (["data.gym_seed=1"], "data.gym_seed=1 is read only with"),
        ([SOURCE, "data.gym_size=0"], r"data.gym_size=0 must be in \[1, 1000000\]"),
        ([SOURCE, "data.gym_seed=-1"], "data.gym_seed=-1 must be >= 0"),
        ([SOURCE, "data.gym_options=[1]"], "data.gym_options=.* must be a mapping"),
        ([SOURCE, "data.gym_options={1: 2}"], "data.gym_options=.* must be a mapping"),
        (["data.source='reasoning_gym:'"], "names no task"),
        (["data.answer_marker=x"], "data.answer_marker='x' is read only with a reasoning_gym"),
        ([SOURCE, "data.answer_marker=x"], "read by reward.kind=reasoning_gym .reward.kind=math"),
        ([SOURCE, "reward.kind=reasoning_gym", "data.min_working_words=5"], "set data.answer_m"),
        ([SOURCE, "data.min_working_words=-1"], "data.min_working_words"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config(None, overrides)
    assert "\n" not in str(info.value)
