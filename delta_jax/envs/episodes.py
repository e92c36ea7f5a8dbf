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
has no room to continue). Nothing an environment raises ends the rollout: the episode ends
there and ``episode/env_errors`` counts it.

Stop strings are matched on their canonical token ids (``tokenizer.encode(s)``): a model that
writes the same text with other tokens does not end its turn there.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from delta_jax.envs.base import (
    Environment,
    StepResult,
    _decode,
    _encode,
    render_observation,
    truncate_middle,
)
from delta_jax.sampling.engine import Turns

log = logging.getLogger(__name__)


def as_factory(environment: Any, tokenizer: Any = None) -> Callable[[], Environment]:
    """A zero-argument factory of fresh environments from an environment object (copied for
    each episode; a tokenizer it holds is shared, not copied) or a factory."""
    if not isinstance(environment, type) and isinstance(environment, Environment):
        keep = {id(tokenizer): tokenizer} if tokenizer is not None else {}
        return lambda: copy.deepcopy(environment, dict(keep))
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
        encoded = tuple(_encode(tokenizer, s))
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
    ):
        probe = factory()
        self.factory, self.tokenizer = factory, tokenizer
        self.stop_strings = tuple(probe.stop_strings)
        self.tools = tuple(probe.tools) or None
        self.stop_ids, self.stop_sequences = stop_tokens(self.stop_strings, tokenizer)
        self.max_turns, self.max_observation_tokens = max_turns, max_observation_tokens
        self.end_ids = frozenset(int(i) for i in end_ids)
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "episode")

    def start(self, rows: Sequence[Mapping[str, Any]]) -> Episodes:
        """One fresh environment per row, ``reset`` on it; the engine's multi-turn request."""
        return Episodes(self, rows)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclasses.dataclass
class _Episode:
    env: Environment
    user: str  # the first user turn
    turns: int = 0  # model turns stepped or handed over
    next_turn: int = 0  # column where the current turn starts
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_error: bool = False
    turn_limit: bool = False
    reward: float | None = None


class Episodes:
    """The episodes of one engine call (``rows[r]`` is request row ``r``: prompt-major)."""

    def __init__(self, runner: EpisodeRunner, rows: Sequence[Mapping[str, Any]]):
        self.runner = runner
        self.episodes = []
        for row in rows:
            env = runner.factory()
            self.episodes.append(_Episode(env, env.reset(row)))
        self.turns = Turns(
            stop_ids=runner.stop_ids,
            max_turns=runner.max_turns,
            submit=self.submit,
            stop_sequences=runner.stop_sequences,
        )

    def submit(self, row: int, turn: list[int]) -> concurrent.futures.Future:
        """The engine's hand-over: the observation's ids (or None), computed in the pool."""
        return self.runner._pool.submit(self._answer, row, list(turn))

    def _step(self, row: int, turn: list[int]) -> StepResult | None:
        episode, runner = self.episodes[row], self.runner
        episode.turns += 1
        episode.next_turn += len(turn)
        try:
            result = episode.env.step(_decode(runner.tokenizer, turn))
        except Exception as e:  # an environment's bug ends its episode, not the rollout
            log.warning("environment step failed (episode ended): %s: %s", type(e).__name__, e)
            episode.env_error = True
            return None
        info = result.info or {}
        if info.get("tool_call"):
            episode.tool_calls += 1
            episode.tool_errors += info.get("error") is not None
            episode.tool_timeouts += info.get("error") == "timeout"
        if result.reward is not None:
            episode.reward = float(result.reward)
        return result

    def _answer(self, row: int, turn: list[int]) -> list[int] | None:
        episode, runner = self.episodes[row], self.runner
        result = self._step(row, turn)
        if result is None or result.done or result.observation is None:
            return None
        observation = truncate_middle(
            result.observation, runner.max_observation_tokens, runner.tokenizer
        )
        text = render_observation(
            observation,
            runner.tokenizer if runner.chat else None,
            messages=[{"role": "user", "content": episode.user}],
            tools=runner.tools,
        )
        ids = _encode(runner.tokenizer, text)
        episode.next_turn += len(ids)
        return ids

    def finish(self, row: int, tokens: Sequence[int]) -> None:
        """The episode is over (``tokens``: its whole response): its last turn is stepped when
        it ended at EOS; a turn ended at a stop with no turn left counts as ``turn_limit``."""
        episode = self.episodes[row]
        last = list(tokens[episode.next_turn :])
        if not last or episode.env_error:  # over at a hand-over (or the env failed there)
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
