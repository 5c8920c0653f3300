"""AdamW and clipping as recorded on the tape (``optim.py``), replayed by every host
backend with the new param and moments written in place (``memplan.in_place_updates``),
against ``torch.optim.AdamW`` after ``torch.nn.utils.clip_grad_norm_``, float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradtape as gt
from gradtape import ops
from gradtape.ops import PRIMS
from gradtape.optim import AdamWConfig, adamw, clip_by_global_norm

from support.compare import rel_err
from support.fd import BACKENDS

STEPS = 4
LR = 0.05


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((6, 5)), rng.standard_normal((5, 4)), rng.standard_normal(4))


def _ours(backend, clip, cfg, xa, wa, ba):
    tp = gt.Tape(np.float64, eager=False)
    x, w, b = tp.const(xa), tp.param(wa), tp.param(ba)
    y = ops.tanh(ops.add(ops.matmul(x, w), b))  # [6, 4]
    loss = ops.reduce_sum(ops.mul(y, y))
    grads = tp.backward(loss)
    g = [grads[w], grads[b]]
    if clip:
        g, _ = clip_by_global_norm(g, clip)
    new, scalars, moments = adamw(tp, [w, b], g, cfg)
    prog = tp.compile([loss], backend=backend, updates=new, donate=list(new))
    assert len(prog.memory.in_place) == len(new)  # no copy of a new value, no region
    for step in range(1, STEPS + 1):
        prog.run(scalars.values(step, LR))
    return [prog.state(w), prog.state(b)], [prog.state(m) for pair in moments for m in pair]


def _torch(clip, cfg, xa, wa, ba):
    x = torch.tensor(xa)
    w, b = torch.tensor(wa, requires_grad=True), torch.tensor(ba, requires_grad=True)
    opt = torch.optim.AdamW([w, b], lr=LR, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    for _ in range(STEPS):
        opt.zero_grad()
        y = torch.tanh(x @ w + b)
        (y * y).sum().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([w, b], clip)
        opt.step()
    st = [opt.state[p] for p in (w, b)]
    return ([w.detach().numpy(), b.detach().numpy()],
            [s[k].numpy() for s in st for k in ("exp_avg", "exp_avg_sq")])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_adamw_in_place_equals_torch(backend, clip):
    cfg = AdamWConfig(weight_decay=0.1)
    data = _data()
    params, moments = _ours(backend, clip, cfg, *data)
    ref_params, ref_moments = _torch(clip, cfg, *data)
    for got, ref in zip(params + moments, ref_params + ref_moments):
        assert rel_err(got, ref) < 1e-10


def test_an_update_whose_old_value_is_read_later_is_not_written_in_place():
    """A leaf read after its new value is computed keeps a region and a copy: the later
    read sees the old value."""
    for backend in BACKENDS:
        tp = gt.Tape(np.float64, eager=False)
        a = tp.param(np.arange(4.0))
        new = ops.scale(a, 2.0)
        late = ops.addc(a, 1.0)  # recorded after the update's source
        prog = tp.compile([late], backend=backend, updates={a: new}, donate=[a])
        assert not prog.memory.in_place
        (out,) = prog.run()
        np.testing.assert_array_equal(out, np.arange(4.0) + 1)
        np.testing.assert_array_equal(prog.state(a), 2 * np.arange(4.0))
        (out,) = prog.run()
        np.testing.assert_array_equal(out, 2 * np.arange(4.0) + 1)


def test_a_donated_leaf_keeps_its_state_in_the_tape_array():
    tp = gt.Tape(np.float64, eager=False)
    a = tp.param(np.ones(3))
    prog = tp.compile([ops.reduce_sum(a)], backend="cpu", updates={a: ops.scale(a, 3.0)},
                      donate=[a])
    prog.run()
    np.testing.assert_array_equal(a.value, np.full(3, 3.0))  # the tape's array is the state


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_update_runs_once_its_gradient_is_complete(backend):
    """Without clipping, a layer's AdamW update runs before backward reaches the layer
    below (its gradient dies there, not at the step's end), and the values are those of
    the recording order."""
    rng = np.random.default_rng(1)
    tp = gt.Tape(np.float64, eager=False)
    h = tp.const(rng.standard_normal((8, 24)))  # 24 terms a product: never fused (FUSED_K)
    ws = [tp.param(rng.standard_normal((24, 24)) * 0.2) for _ in range(3)]
    for w in ws:
        h = ops.tanh(ops.matmul(h, w))  # [8, 24]
    loss = ops.reduce_sum(ops.mul(h, h))
    grads = tp.backward(loss)
    new, scalars, _ = adamw(tp, ws, [grads[w] for w in ws], AdamWConfig())
    prog = tp.compile([loss], backend=backend, updates=new, donate=list(new))
    ex = prog.executable
    steps = ex.schedule.steps
    where = {v: i for i, s in enumerate(steps)
             for v in (s.outputs if hasattr(s, "outputs") else (s,))}
    src = dict(ex.graph.updates)
    first_param = next(leaf for leaf in src if leaf.op == "param" and leaf.index == ws[0].index)
    last_param = next(leaf for leaf in src if leaf.op == "param" and leaf.index == ws[2].index)
    # the top layer's new weight is written before the bottom layer's, and before the
    # last matmul of backward
    assert where[src[last_param]] < where[src[first_param]]
    assert where[src[last_param]] < max(i for i, s in enumerate(steps)
                                        if getattr(s, "op", "") == "matmul")
    ref = _replay_reference(ws, new, scalars)
    prog.run(scalars.values(1, LR))
    for w, r in zip(ws, ref):
        if backend == "numpy":  # the same NumPy forwards in another order: bitwise
            np.testing.assert_array_equal(prog.state(w), r)
        else:  # generated C: the same math, other rounding
            assert rel_err(prog.state(w), r) < 1e-12


def _replay_reference(ws, new, scalars):
    """One step with every op in recording order, each on its own (no compile passes)."""
    vals = {}
    feeds = scalars.values(1, LR)
    needed = set()
    stack = list(new.values())
    while stack:
        v = stack.pop()
        if v not in needed:
            needed.add(v)
            stack.extend(v.inputs)
    for v in sorted(needed, key=lambda v: v.index):
        if v.is_leaf:
            vals[v] = np.asarray(feeds.get(v, v._value), v.dtype)
            continue
        out = np.empty(v.shape, v.dtype)
        PRIMS[v.op].forward(out, *(vals[x] for x in v.inputs), **v.attrs)
        vals[v] = out
    return [vals[new[w]] for w in ws]
