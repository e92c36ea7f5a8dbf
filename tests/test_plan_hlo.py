"""The planner's loop-aware cost (``delta_jax.plan.hlo.loop_cost``) on XLA:CPU programs: XLA's
cost analysis counts a loop body once; ``loop_cost`` counts it its trip count times."""

import jax
import jax.numpy as jnp
import pytest

from delta_jax.plan.hlo import loop_cost

N = 64


def _step(x):
    return jnp.tanh(x @ x)


def _costs(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.cost_analysis()["flops"], loop_cost(compiled.as_text())


@pytest.fixture(scope="module")
def x():
    return jnp.ones((N, N), jnp.float32)


@pytest.fixture(scope="module")
def one_step(x):
    return jax.jit(_step).lower(x).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("lower, upper", [(0, 10), (2, 9)])
def test_fori_loop_counts_its_trips(x, one_step, lower, upper):
    once, cost = _costs(lambda x: jax.lax.fori_loop(lower, upper, lambda i, x: _step(x), x), x)
    assert once < 1.01 * one_step  # the cost analysis: one body
    assert cost.flops == pytest.approx((upper - lower) * one_step, rel=1e-3)
    assert (cost.loops, cost.unknown_trips) == (1, 0)


def test_nested_scans_multiply(x, one_step):
    def inner(x):
        return jax.lax.scan(lambda c, _: (_step(c), None), x, None, length=4)[0]

    _, cost = _costs(lambda x: jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=3)[0], x)
    assert cost.flops == pytest.approx(12 * one_step, rel=1e-3)
    assert (cost.loops, cost.unknown_trips) == (2, 0)
    assert max(cost.runs.values()) == 12  # the inner body runs 3 x 4 times


def test_loop_bounded_at_run_time_counts_once(x, one_step):
    def fn(x, k):
        return jax.lax.while_loop(
            lambda c: c[1] < k, lambda c: (_step(c[0]), c[1] + 1), (x, jnp.int32(0))
        )[0]

    once, cost = _costs(fn, x, jnp.int32(5))
    assert cost.flops == pytest.approx(once)
    assert (cost.loops, cost.unknown_trips) == (1, 1)


def test_program_without_loops_is_the_cost_analysis(x, one_step):
    once, cost = _costs(_step, x)
    assert cost.flops == once == one_step and cost.loops == 0


def test_without_the_hlo_parser_the_cost_analysis_counts_loops_once(x, monkeypatch):
    from delta_jax.plan import report

    def missing(text):
        raise ImportError("no HLO text parser")

    compiled = jax.jit(lambda x: jax.lax.fori_loop(0, 10, lambda i, x: _step(x), x))
    compiled = compiled.lower(x).compile()
    full = report.ProgramMemory.of(compiled, 0.0)
    monkeypatch.setattr(report, "loop_cost", missing)
    once = report.ProgramMemory.of(compiled, 0.0)
    assert (full.loops_counted_once, once.loops_counted_once) == (0, 1)
    assert once.flops == compiled.cost_analysis()["flops"]
    assert full.flops == pytest.approx(10 * once.flops, rel=1e-3)
