"""Episodes: the host side of a multi-turn rollout on the continuous engine.

An :class:`EpisodeRunner` is built once per run from an environment factory; each rollout (or
evaluation) call starts one :class:`Episodes` over its rows — one environment per sequence,
``reset`` on its data row — and hands the engine ``episodes.turns``. The engine decodes a turn
until one of the environment's stop strings (a stop id when the string is one token, else a
stop sequence matched on device), then calls :meth:`Episodes.submit`: the turn's text is
stepped in the runner's thread pool (tool calls run concurrently, while the engine decodes
other sequences), and the observation comes back as ids — cut middle-out to
``max_observation_tokens``, rendered as the next text of the context by
:func:`~delta_jax.envs.render_observation` (a ``tool`` message with a chat template) — or
``None`` when the episode is over.

A turn that ends at EOS is the episode's last: it is stepped once the episode is over
(:meth:`Episodes.finish`), so that an environment that scores its episodes gets to; a turn
cut by the token budget or the turn limit is not stepped (no tool runs for a turn the episode
has no room to continue). Nothing an environment does ends the rollout: an exception from its
factory, ``reset`` or ``step``, or a value outside the protocol (``reset`` not giving a
``str``; ``step`` not giving a :class:`~delta_jax.envs.StepResult` whose observation is a
``str`` or None, ``done`` a bool, ``reward`` a finite number or None, ``info`` a mapping or
None; text that is not valid Unicode, such as an unpaired surrogate) ends that episode where it
happens, ``episode/env_errors`` counts it, and the first failure of each kind is logged once (one
line: the environment's class, where, what was wrong). A huge observation is not a failure: it is
cut (by characters, then middle-out to ``max_observation_tokens``) before it is tokenised.

A hang is a failure too when the runner has a deadline (``timeout_s``; the trainer gives
``rollout.tool_timeout_s`` to every environment but ``python_tool``, which bounds its own calls
by it): a factory + ``reset`` or a ``step`` still running past it ends its episode, counted and
logged like the rest. The call runs in a daemon thread that is abandoned then: Python cannot
stop a thread, so it may run on, holding its environment, until it returns (a hung call holds
no pool thread and no decode slot; it does not keep the process from exiting). The resets of a
rollout run ``workers`` at a time, so an environment whose every ``reset`` hangs costs
``ceil(rows / workers)`` deadlines.

Stop strings are matched on their canonical token ids (``tokenizer.encode(s)``): a model that
writes the same text with other tokens does not end its turn there.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import logging
import math
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from delta_jax.envs.base import (
    Environment,
    StepResult,
    decode_ids,
    encode_text,
    render_observation,
    truncate_middle,
)
from delta_jax.rewards.custom import error_line
from delta_jax.sampling.engine import Turns

log = logging.getLogger(__name__)


class EnvironmentFailure(Exception):
    """An environment broke the protocol (a value it must not return); ``kind`` names what."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _kind(value: Any) -> str:
    """A bad value, briefly: its type, and its value for a number (never its ``repr``, which
    may be huge or raise)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            text = repr(value) if type(value) in (int, float) else repr(float(value))
        except Exception:  # a number whose __float__ raises, an int too long to print
            return type(value).__name__
        return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
    if isinstance(value, bool) or value is None:
        return repr(value)
    return type(value).__name__


def check_text(value: Any, what: str) -> str:
    """`value` as a plain ``str`` when it is text the tokenizer can take (valid Unicode).

    Raises:
      EnvironmentFailure: not a ``str``, or a ``str`` with unpaired surrogates.
    """
    if not isinstance(value, str):
        raise EnvironmentFailure(what, f"{what} is {_kind(value)}, not a str")
    text = str.__str__(value)  # a plain str, whatever a subclass overrides
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EnvironmentFailure(
            what, f"{what} is not valid Unicode (an unpaired surrogate at index {e.start})"
        ) from None
    return text


def check_step(result: Any) -> StepResult:
    """`result` when it is a :class:`StepResult` within the protocol (see the module docstring).

    Raises:
      EnvironmentFailure: the first field that is not.
    """
    if not isinstance(result, StepResult):
        raise EnvironmentFailure(
            "step", f"step returned {_kind(result)}, not a StepResult(observation, done, ...)"
        )
    if not isinstance(result.done, bool | np.bool_):
        raise EnvironmentFailure("done", f"StepResult.done is {_kind(result.done)}, not a bool")
    observation = result.observation
    if observation is not None:
        observation = check_text(observation, "StepResult.observation")
    reward = result.reward
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise EnvironmentFailure(
                "reward", f"StepResult.reward is {_kind(reward)}, not a number or None"
            )
        reward = float(reward)
        if not math.isfinite(reward):
            raise EnvironmentFailure("reward", f"StepResult.reward is {reward!r}, not finite")
    info = result.info
    if info is not None and not isinstance(info, Mapping):
        raise EnvironmentFailure("info", f"StepResult.info is {_kind(info)}, not a mapping")
    return StepResult(observation, bool(result.done), reward, dict(info or {}))


def as_factory(environment: Any, tokenizer: Any = None) -> Callable[[], Environment]:
    """A zero-argument factory of fresh environments from an environment object (copied for
    each episode; a tokenizer it holds is shared, not copied) or a factory."""
    if not isinstance(environment, type) and isinstance(environment, Environment):
        keep = {id(tokenizer): tokenizer} if tokenizer is not None else {}

        def fresh() -> Environment:
            return copy.deepcopy(environment, dict(keep))

        fresh.__name__ = type(environment).__name__  # what messages call the factory
        return fresh
    if callable(environment):
        return environment
    raise ValueError(
        "environment must be an Environment (reset, step, stop_strings, tools) or a callable "
        f"returning one, got {type(environment).__name__}"
    )


def stop_tokens(
    stop_strings: Sequence[str], tokenizer: Any
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(stop ids, stop sequences): each string's canonical ids, one id or several."""
    ids, sequences = [], []
    for s in stop_strings:
        encoded = tuple(encode_text(tokenizer, s))
        if not encoded:
            raise ValueError(f"the stop string {s!r} encodes to no tokens")
        if len(encoded) == 1:
            ids.append(encoded[0])
        else:
            sequences.append(encoded)
    return tuple(dict.fromkeys(ids)), tuple(dict.fromkeys(sequences))


def episode_row(record: Any) -> dict[str, Any]:
    """The data row an environment's ``reset`` reads, from a :class:`PromptRecord`."""
    return {
        "prompt": record.prompt,
        "answer": record.answer,
        "system": record.system,
        "tests": record.tests,
        **record.extra,
    }


class EpisodeRunner:
    """Environments for the multi-turn rollouts of a run (see the module docstring).

    Args:
      factory: returns a fresh :class:`~delta_jax.envs.Environment` per episode.
      tokenizer: the policy's tokenizer.
      max_turns: model turns per episode (``>= 1``).
      max_observation_tokens: an observation is cut middle-out to this many tokens.
      end_ids: the ids that end an episode (EOS): a turn ending at one is stepped at the end.
      workers: threads stepping environments (tool calls) at once.
      timeout_s: deadline of one environment call (the factory and ``reset`` together, or one
        ``step``); None: none (module docstring).
    """

    def __init__(
        self,
        factory: Callable[[], Environment],
        tokenizer: Any,
        *,
        max_turns: int,
        max_observation_tokens: int,
        end_ids: Sequence[int],
        workers: int = 8,
        timeout_s: float | None = None,
    ):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.timeout_s = timeout_s
        try:
            probe = self.call(factory, "the factory")
        except Exception as e:  # at start-up: one line (a ConfigError upstream)
            name = getattr(factory, "__name__", type(factory).__name__)
            cause = str(e) if isinstance(e, EnvironmentFailure) else error_line(e)
            raise ValueError(f"environment {name}: the factory failed: {cause}") from None
        self.factory, self.tokenizer = factory, tokenizer
        self.env_name = type(probe).__name__
        self.stop_strings = tuple(probe.stop_strings)
        self.tools = tuple(probe.tools) or None
        self.stop_ids, self.stop_sequences = stop_tokens(self.stop_strings, tokenizer)
        self.max_turns, self.max_observation_tokens = max_turns, max_observation_tokens
        truncate_middle("", max_observation_tokens, tokenizer)  # a limit too small: ValueError
        self.end_ids = frozenset(int(i) for i in end_ids)
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "episode")
        self._reported: set[tuple[str, str, str]] = set()
        self._report_lock = threading.Lock()

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` within the deadline (module docstring): its value, or its exception.

        Raises:
          EnvironmentFailure: ``fn`` was still running at the deadline (kind ``"timeout"``), or
            raised what is not an ``Exception`` (``SystemExit``...).
        """
        if self.timeout_s is None:
            return fn()
        box: list = []

        def run() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box.append((False, e))

        thread = threading.Thread(target=run, daemon=True, name="environment-call")
        thread.start()
        thread.join(self.timeout_s)
        if not box:
            raise EnvironmentFailure(
                "timeout",
                f"{what} did not return within {self.timeout_s:g} s (rollout.tool_timeout_s); "
                "the call was abandoned to its thread",
            )
        ok, value = box[0]
        if ok:
            return value
        if isinstance(value, Exception):
            raise value
        raise EnvironmentFailure(type(value).__name__, f"{what} raised {error_line(value)}")

    def start(self, rows: Sequence[Mapping[str, Any]], held: Sequence[Any] | None = None):
        """One fresh environment per row, ``reset`` on it, or the ``held`` episode to continue
        (partial rollouts, :class:`Episodes`); the engine's multi-turn request."""
        return Episodes(self, rows, held)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def report(self, env: Any, where: str, error: Exception) -> None:
        """Logs an environment's failure (its episode ended), once per kind of failure."""
        name = self.env_name if env is None else type(env).__name__
        kind = error.kind if isinstance(error, EnvironmentFailure) else type(error).__name__
        cause = str(error) if isinstance(error, EnvironmentFailure) else error_line(error)
        with self._report_lock:
            if (name, where, kind) in self._reported:
                return
            self._reported.add((name, where, kind))
        log.warning(
            "environment %s: %s: %s (episode ended; counted in episode/env_errors, further "
            "failures like it are not logged)",
            name,
            where,
            cause,
        )


@dataclasses.dataclass
class _Episode:
    env: Environment | None  # None: its factory failed
    user: str  # the first user turn
    turns: int = 0  # model turns stepped or handed over
    next_turn: int = 0  # column where the current turn starts
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_error: bool = False
    turn_limit: bool = False
    reward: float | None = None
    steps: list[str] = dataclasses.field(default_factory=list)  # the turns' texts stepped

    def state(self) -> dict[str, Any]:
        """Everything but the environment, as JSON values (a partial rollout's checkpoint):
        :meth:`Episodes` rebuilds the environment from it by replaying its steps."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "env"}
        return state | {"steps": list(self.steps)}


class Episodes:
    """The episodes of one engine call (``rows[r]`` is request row ``r``: prompt-major).

    ``held`` (partial rollouts): per row, None for a new episode, an episode of an earlier call
    to continue (:meth:`episode`: its environment as it was), or such an episode's
    :meth:`_Episode.state` (from a checkpoint): its environment is built again, ``reset`` on
    its row and stepped with its turns' texts again, in order. So an environment resumes
    exactly when its ``reset`` and ``step`` are deterministic in the texts they get; one whose
    replayed ``reset`` gives another first user turn, or that fails while replayed, ends its
    episode (counted in ``episode/env_errors``).
    """

    def __init__(
        self,
        runner: EpisodeRunner,
        rows: Sequence[Mapping[str, Any]],
        held: Sequence[Any] | None = None,
    ):
        self.runner = runner
        held = list(held) if held is not None else [None] * len(rows)
        if len(held) != len(rows):
            raise ValueError(f"held has {len(held)} entries for {len(rows)} rows")
        self.episodes = [h if isinstance(h, _Episode) else _Episode(None, "") for h in held]
        start = [(e, row, h) for e, row, h in zip(self.episodes, rows, held, strict=True)]
        start = [job for job in start if not isinstance(job[2], _Episode)]
        # In the pool, so that hung resets cost their deadline ``workers`` at a time.
        list(runner._pool.map(lambda job: self._start(*job), start))
        self.turns = Turns(
            stop_ids=runner.stop_ids,
            max_turns=runner.max_turns,
            submit=self.submit,
            stop_sequences=runner.stop_sequences,
        )

    def episode(self, row: int) -> _Episode:
        """Row ``row``'s episode, to continue in a later call (``held``)."""
        return self.episodes[row]

    def _start(self, episode: _Episode, row: Mapping[str, Any], state: dict | None) -> None:
        """A new episode (``reset`` on its row), or one rebuilt from its ``state``."""
        if state is not None:
            for key, value in state.items():
                setattr(episode, key, list(value) if key == "steps" else value)
            if episode.env_error:  # its environment had failed: nothing to rebuild
                return
        user = episode.user

        def reset() -> Any:
            episode.env = self.runner.factory()
            return episode.env.reset(row)

        try:
            episode.user = check_text(self.runner.call(reset, "reset"), "reset's first user turn")
            if state is None:
                return
            if episode.user != user:
                raise EnvironmentFailure(
                    "replay", "reset gave another first user turn when the episode was resumed"
                )
            for text in episode.steps:
                check_step(self.runner.call(lambda t=text: episode.env.step(t), "step"))
        except Exception as e:  # the episode's first turn is generated, never stepped
            self._fail(episode, "reset" if state is None else "replay", e)

    def submit(self, row: int, turn: list[int]) -> concurrent.futures.Future:
        """The engine's hand-over: the observation's ids (or None), computed in the pool."""
        return self.runner._pool.submit(self._answer, row, list(turn))

    def _fail(self, episode: _Episode, where: str, error: Exception) -> None:
        episode.env_error = True
        self.runner.report(episode.env, where, error)

    def _step(self, row: int, turn: list[int]) -> StepResult | None:
        """The environment's answer to a turn, within the protocol; None when the episode's
        environment failed (now or before)."""
        episode, runner = self.episodes[row], self.runner
        episode.turns += 1
        episode.next_turn += len(turn)
        if episode.env_error:
            return None
        try:
            text = decode_ids(runner.tokenizer, turn)
            episode.steps.append(text)
            result = check_step(runner.call(lambda: episode.env.step(text), "step"))
            info = result.info
            tool_call = bool(info.get("tool_call"))
            error = info.get("error")
            timeout = tool_call and isinstance(error, str) and error == "timeout"
        except Exception as e:  # an environment's bug ends its episode, not the rollout
            self._fail(episode, "step", e)
            return None
        if tool_call:
            episode.tool_calls += 1
            episode.tool_errors += error is not None
            episode.tool_timeouts += timeout
        if result.reward is not None:
            episode.reward = result.reward
        return result

    def _answer(self, row: int, turn: list[int]) -> list[int] | None:
        episode, runner = self.episodes[row], self.runner
        result = self._step(row, turn)
        if result is None or result.done or result.observation is None:
            return None
        try:
            # A huge output is cut by characters first (far more than the tokens kept, at both
            # ends), so that only a bounded text is tokenised.
            text, keep = result.observation, 64 * runner.max_observation_tokens + 4096
            if len(text) > 2 * keep:
                text = text[:keep] + text[len(text) - keep :]
            observation = truncate_middle(text, runner.max_observation_tokens, runner.tokenizer)
            text = render_observation(
                observation,
                runner.tokenizer if runner.chat else None,
                messages=[{"role": "user", "content": episode.user}],
                tools=runner.tools,
            )
            ids = encode_text(runner.tokenizer, text)
        except Exception as e:  # an observation the tokenizer or template refuses
            self._fail(episode, "observation", e)
            return None
        episode.next_turn += len(ids)
        return ids

    def finish(self, row: int, tokens: Sequence[int]) -> None:
        """The episode is over (``tokens``: its whole response): its last turn is stepped when
        it ended at EOS; a turn ended at a stop with no turn left counts as ``turn_limit``."""
        episode = self.episodes[row]
        last = list(tokens[episode.next_turn :])
        if not last:  # over at a hand-over
            return
        if episode.env_error:  # its environment failed at reset: nothing to step
            episode.turns += 1
            return
        if last[-1] in self.runner.end_ids:
            self._step(row, last)
            return
        episode.turns += 1  # cut by the budget, or a stop with no turn left
        episode.turn_limit = episode.turns >= self.runner.max_turns and self._ends_turn(last)

    def _ends_turn(self, ids: list[int]) -> bool:
        runner = self.runner
        return ids[-1] in runner.stop_ids or any(
            tuple(ids[-len(s) :]) == s for s in runner.stop_sequences
        )

    def rewards(self) -> np.ndarray | None:
        """Rewards the environments gave (0 where none), or None when none gave any."""
        given = [e.reward for e in self.episodes]
        if all(r is None for r in given):
            return None
        return np.asarray([0.0 if r is None else r for r in given], np.float32)

    def stats(self) -> dict[str, float]:
        """Per-episode means: model turns, tool calls, tool errors and timeouts; fractions of
        episodes that hit the turn limit or whose environment raised."""
        episodes = self.episodes
        mean = lambda f: float(np.mean([f(e) for e in episodes]))
        return {
            "episode/turns": mean(lambda e: e.turns),
            "episode/tool_calls": mean(lambda e: e.tool_calls),
            "episode/tool_errors": mean(lambda e: e.tool_errors),
            "episode/tool_timeouts": mean(lambda e: e.tool_timeouts),
            "episode/turn_limit": mean(lambda e: e.turn_limit),
            "episode/env_errors": mean(lambda e: e.env_error),
        }
