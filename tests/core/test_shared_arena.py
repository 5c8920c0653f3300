"""Programs sharing one ``SharedArena`` (a training step and its eval program): the
same values, bitwise, as each with buffers of its own, replayed in any order; the arena
as large as the largest program's plan; a larger program joining later moves the others
onto its buffer."""

from __future__ import annotations

import numpy as np
import pytest

import gradtape as gt
from gradtape import ops
from gradtape.backends.base import SharedArena

from support.fd import BACKENDS


def _record(tp, rng, t=12, d=8, n=6):
    """A two-layer tanh MLP's loss, an SGD update of its weights, and a smaller eval
    loss (the first layer only); returns (x, (step outputs, updates), eval outputs)."""
    x = tp.const(rng.standard_normal((t, d)))
    w1, w2 = tp.param(rng.standard_normal((d, n)) * 0.5), tp.param(rng.standard_normal((n, n)))
    h = ops.tanh(ops.matmul(x, w1))  # [t, n]
    loss = ops.reduce_sum(ops.mul(ops.tanh(ops.matmul(h, w2)), h))
    grads = tp.backward(loss)
    updates = {w: ops.sub(w, ops.scale(grads[w], 0.01)) for w in (w1, w2)}
    return x, ([loss, grads[w1]], updates), [ops.reduce_sum(ops.mul(h, h))]


def _pair(tp, step, evals, backend, arena):
    (outs, updates) = step
    return (tp.compile(outs, backend=backend, updates=updates, arena=arena),
            tp.compile(evals, backend=backend, arena=arena))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_shared_arena_is_bitwise_each_programs_own(backend, dtype):
    rng = np.random.default_rng(0)
    tp = gt.Tape(dtype, eager=False)
    x, step, evals = _record(tp, rng)
    own = _pair(tp, step, evals, backend, None)
    arena = SharedArena()
    shared = _pair(tp, step, evals, backend, arena)
    # interleaved as a run does: steps, an evaluation between them, new data each time
    for i, which in enumerate([0, 1, 0, 0, 1, 1, 0, 1]):
        feed = {x: rng.standard_normal(x.shape)}
        a, b = own[which].run(feed), shared[which].run(feed)
        for u, v in zip(a, b):
            assert np.array_equal(u, v), (i, which)
    for leaf in step[1]:
        assert np.array_equal(own[0].state(leaf), shared[0].state(leaf))
    # one buffer per dtype, as large as the larger plan, read by both programs
    sizes = [p.memory.nbytes for p in shared]
    assert arena.nbytes >= max(sizes) and arena.nbytes < sum(sizes)
    bufs = [p.executable._buffers[0] for p in shared]
    assert bufs[0] is bufs[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_larger_program_joining_later_moves_the_others(backend):
    """The eval program compiled and run first, the step (a larger plan) after it: the
    arena grows, and the eval program's next replay reads the new buffer, with the same
    values as its own-buffer twin."""
    rng = np.random.default_rng(1)
    tp = gt.Tape(np.float64, eager=False)
    x, step, evals = _record(tp, rng)
    arena = SharedArena()
    ev = tp.compile(evals, backend=backend, arena=arena)
    ev_own = tp.compile(evals, backend=backend)
    feed = {x: rng.standard_normal(x.shape)}
    assert np.array_equal(ev.run(feed)[0], ev_own.run(feed)[0])
    small = arena.nbytes
    st = tp.compile(step[0], backend=backend, updates=step[1], arena=arena)
    assert arena.nbytes > small
    st.run({x: rng.standard_normal(x.shape)})
    feed = {x: rng.standard_normal(x.shape)}
    assert np.array_equal(ev.run(feed)[0], ev_own.run(feed)[0])
    assert ev.executable._buffers[0] is st.executable._buffers[0]


def test_a_training_step_shares_one_arena(monkeypatch):
    """``TrainStep``'s step and eval programs draw from one arena (and the fused head's
    scratch tiles): the estimate counts the larger plan, not the sum; the shared run
    trains as the one with buffers of each program's own, bitwise."""
    from gradtape.models import graph
    from gradtape.models.lora import init_adapter
    from gradtape.train import step as S
    from gradtape.train.memory import estimate
    from gradtape.train.step import TrainStep
    from support.tinymodel import tiny_model

    monkeypatch.setattr(graph, "HEAD_FUSE_MIN", 0)  # the fused head at these sizes
    model = tiny_model()
    adapter = init_adapter(model.config, 4, 8)
    step = TrainStep(model, adapter, 2, 8, backend="cpu")
    plans = [step.program.memory.nbytes, step.eval_program.memory.nbytes]
    step.eval_program.run()  # compiled first, it moves onto the step's larger buffer
    assert step.program.executable._buffers[0] is step.eval_program.executable._buffers[0]
    assert max(plans) <= estimate(model, step).activations < sum(plans)
    tiles = [p.executable._ctiles for p in (step.program, step.eval_program)]
    assert tiles[0] and tiles[0].keys() == tiles[1].keys()
    assert all(tiles[0][k] is tiles[1][k] for k in tiles[0])

    class OwnArena(SharedArena):  # each program its own buffers, as without sharing
        def buffers(self, sizes):
            return SharedArena().buffers(sizes)

        def kept(self, key, make):
            return make()

    monkeypatch.setattr(S, "SharedArena", OwnArena)
    own = TrainStep(model, init_adapter(model.config, 4, 8), 2, 8, backend="cpu")
    rng = np.random.default_rng(3)
    for i in range(3):
        ids = rng.integers(0, model.config.vocab_size, (2, 8))
        batch = [(ids, np.roll(ids, -1, 1))]
        assert step.step(batch, i + 1, 1e-2) == own.step(batch, i + 1, 1e-2)
        seqs = [(ids, np.roll(ids, -1, 1))]
        a = step.eval_program.run(step._feeds(seqs[0], 1))
        b = own.eval_program.run(own._feeds(seqs[0], 1))
        assert np.array_equal(a[0], b[0])
    for x, y in zip(step.adapter_weights().values(), own.adapter_weights().values()):
        assert all(np.array_equal(u, v) for u, v in zip(x, y))
