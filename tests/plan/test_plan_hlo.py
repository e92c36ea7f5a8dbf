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


# A program as the TPU compiler prints one: a weight prefetched into on-chip memory (memory space
# 1) by an asynchronous copy, a fusion reading it there and writing its result to HBM, inside a
# loop of 3 trips.
_ON_CHIP = """HloModule on_chip

%fused_computation (w: f32[256,256], a: f32[8,256]) -> f32[8,256] {
  %a = f32[8,256]{1,0} parameter(1)
  %w = f32[256,256]{1,0:S(1)} parameter(0)
  ROOT %d = f32[8,256]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], f32[8,256], f32[256,256])) -> (s32[], f32[8,256], f32[256,256]) {
  %p = (s32[], f32[8,256]{1,0}, f32[256,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,256]{1,0} get-tuple-element(%p), index=1
  %w = f32[256,256]{1,0} get-tuple-element(%p), index=2
  %copy-start = (f32[256,256]{1,0:S(1)}, f32[256,256]{1,0}, u32[]) copy-start(%w)
  %copy-done = f32[256,256]{1,0:S(1)} copy-done(%copy-start)
  %fusion = f32[8,256]{1,0} fusion(%copy-done, %x), kind=kOutput, calls=%fused_computation
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8,256]{1,0}, f32[256,256]{1,0}) tuple(%next, %fusion, %w)
}

%cond (p: (s32[], f32[8,256], f32[256,256])) -> pred[] {
  %p = (s32[], f32[8,256]{1,0}, f32[256,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8,256], w: f32[256,256]) -> f32[8,256] {
  %x = f32[8,256]{1,0} parameter(0)
  %w = f32[256,256]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,256]{1,0}, f32[256,256]{1,0}) tuple(%zero, %x, %w)
  %loop = (s32[], f32[8,256]{1,0}, f32[256,256]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %result = f32[8,256]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_bytes_are_hbm_traffic_only():
    """Each trip reads the weight from HBM once (the copy-start's source; not its destination
    in on-chip memory, not the source alias its result repeats, not the copy-done, not the
    fusion's read of the on-chip copy), reads the activations and writes the result to HBM;
    the loop counter's bytes come on top. The cost analysis counts every one of those."""
    weight, activations = 256 * 256 * 4, 8 * 256 * 4
    plain = loop_cost(_ON_CHIP.replace(":S(1)", ""))
    cost = loop_cost(_ON_CHIP)
    assert (cost.loops, cost.unknown_trips) == (1, 0)
    counter = cost.bytes_accessed - 3 * (weight + 2 * activations)
    assert 0 <= counter < 256  # the counter's scalars, the tuples' pointers: 51 bytes a trip
    # The same program with every buffer in HBM counts the copies in full.
    assert plain.bytes_accessed > cost.bytes_accessed + 3 * 2 * weight
    assert plain.flops == cost.flops == pytest.approx(3 * 2 * 8 * 256 * 256, abs=10)


_ASYNC = """HloModule async_op

%wrapped (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %n = f32[1024]{0} negate(%p)
}

ENTRY %main (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0:S(1)} parameter(0)
  %start = ((f32[1024]{0:S(1)}), f32[1024]{0}, s32[]) async-start(%x), calls=%wrapped
  %update = ((f32[1024]{0:S(1)}), f32[1024]{0}, s32[]) async-update(%start)
  ROOT %done = f32[1024]{0} async-done(%update)
}
"""


def test_asynchronous_op_with_an_on_chip_operand():
    """An async op's later halves cannot be costed alone (the v5e LoRA recipe's decode has
    them): they keep their bytes, and the start's read of its on-chip operand comes out."""
    cost, plain = loop_cost(_ASYNC), loop_cost(_ASYNC.replace(":S(1)", ""))
    assert cost.flops == plain.flops == 1024
    assert 4 * 1024 < cost.bytes_accessed <= plain.bytes_accessed - 4 * 1024
