"""Long-context training steps: the fused head in a whole training step equals the
composed one; activation checkpointing (``compile.checkpoint``, ``TrainStep(
grad_checkpoint=...)``) trains the same with less memory, ``auto`` chooses it when needed
or when it pays (``recompute_pays``), and a run that fits neither way is refused before
anything is allocated."""

import dataclasses

import numpy as np
import pytest

from gradtape.errors import GradtapeError
from gradtape.models.lora import init_adapter
from gradtape.train.step import AUTO_SHARE, TrainStep

from support.compare import rel_err
from support.tinymodel import tiny_model


def _batch(t=24, vocab=257, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (2, t))
    tg = np.roll(ids, -1, axis=1)
    tg[:, -1] = -100
    return ids, tg


def _run(model, backend, mode, dtype, t=24, steps=3, limit=None):
    ts = TrainStep(model, init_adapter(model.config, 4, 8.0, seed=1, dtype=dtype), 2, t,
                   backend=backend, dtype=dtype, grad_checkpoint=mode, compute="float32",
                   memory_limit=limit)
    ids, tg = _batch(t)
    losses = [ts.step([(ids, tg)], i + 1, 1e-2) for i in range(steps)]
    return ts, losses, ts.adapter_weights()


def test_fused_head_trains_like_the_composed_head(monkeypatch):
    """Three float64 steps with the head fused into the loss (``ops.head_nll``) and with
    the composed logits + ``nn.cross_entropy_ids``: the same losses and adapters up to
    the blocks' summation order (1e-12)."""
    from gradtape.models import graph as M

    model = tiny_model(seed=4, n_layers=2, tied=True)
    runs, default = {}, M.HEAD_FUSE_MIN
    for fuse_min in (default, 0):
        monkeypatch.setattr(M, "HEAD_FUSE_MIN", fuse_min)
        ts, losses, weights = _run(model, "numpy", "off", np.float64)
        # training: the fused head folds up the x gradient in its forward (head_nll_e)
        assert any(v.op == "head_nll_e" for v in ts.program.graph.ops) == (fuse_min == 0)
        runs[fuse_min] = (losses, weights)
    (l_c, w_c), (l_f, w_f) = runs[default], runs[0]
    assert rel_err(np.array(l_f), np.array(l_c)) <= 1e-12
    for key in w_c:
        for a, b in zip(w_f[key], w_c[key]):
            assert rel_err(a, b) <= 1e-12, key


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_checkpointed_step_trains_the_same(backend, tiled, monkeypatch):
    """The recomputed forward runs the same ops on the same inputs: on numpy the losses,
    norms and adapters are bitwise those without checkpointing; on cpu the fused kernels
    group differently around the clones (float64: rounding only).  The head is the
    fused one (the tiny vocabulary is below the size that fuses it by default); the
    attention tiled (as from ``ATTN_TILED_MIN`` rows) or composed (shorter rows)."""
    from gradtape.models import graph as M

    monkeypatch.setattr(M, "HEAD_FUSE_MIN", 0)
    monkeypatch.setattr(M, "ATTN_TILED_MIN", 0 if tiled else 10 ** 9)
    model = tiny_model(seed=2, n_layers=3)
    dtype = np.float32 if backend == "numpy" else np.float64
    off, l_off, w_off = _run(model, backend, "off", dtype)
    on, l_on, w_on = _run(model, backend, "on", dtype)
    assert on.checkpointed and not off.checkpointed
    # the layers' forward ops appear twice: once in forward, once recomputed in backward
    n = lambda ts, op: sum(v.op == op for v in ts.program.graph.ops)  # noqa: E731
    assert (n(off, "attn"), n(on, "attn")) == ((3, 6) if tiled else (0, 0))
    # the training head's output is kept: backward reads nothing else of it
    assert n(off, "head_nll_e") == 1 and n(on, "head_nll_e") == 1
    tol = 0.0 if backend == "numpy" else 1e-12
    assert rel_err(np.array(l_on), np.array(l_off)) <= tol
    for key in w_off:
        for a, b in zip(w_on[key], w_off[key]):
            assert rel_err(a, b) <= tol, key


def test_checkpointing_needs_less_memory():
    model = tiny_model(seed=2, n_layers=4)
    off, _, _ = _run(model, "numpy", "off", np.float32, t=64, steps=1)
    on, _, _ = _run(model, "numpy", "on", np.float32, t=64, steps=1)
    # 4 layers' activations kept vs one layer's recomputed at a time (and the inputs)
    assert on.program.memory.nbytes < 0.6 * off.program.memory.nbytes


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_auto_recomputes_the_fewest_layers_that_fit(backend, monkeypatch):
    """Between the plans without checkpointing and with every layer recomputed, ``auto``
    recomputes the first layers only, as few as keep the plan within the share; those
    steps train as the others do (numpy: bitwise; cpu: float64 rounding)."""
    from gradtape.models import graph as M

    monkeypatch.setattr(M, "ATTN_TILED_MIN", 0)  # an "attn" op per layer and recompute
    model = tiny_model(seed=2, n_layers=4)
    dtype = np.float32 if backend == "numpy" else np.float64
    probe = TrainStep(model, init_adapter(model.config, 4, 8.0, seed=1, dtype=dtype), 2,
                      64, backend=backend, dtype=dtype, compute="float32")
    need = [probe.planned_memory(n).total for n in range(3)]
    assert need[0] > need[1] > need[2]  # each layer recomputed saves memory
    off, l_off, w_off = _run(model, backend, "off", dtype, t=64)
    for n in (1, 2):
        part, l_part, w_part = _run(model, backend, "auto", dtype, t=64,
                                    limit=need[n] / AUTO_SHARE)
        assert part.checkpointed == n
        assert sum(v.op == "attn" for v in part.program.graph.ops) == 4 + n
        tol = 0.0 if backend == "numpy" else 1e-12
        assert rel_err(np.array(l_part), np.array(l_off)) <= tol
        for key in w_off:
            for a, b in zip(w_part[key], w_off[key]):
                assert rel_err(a, b) <= tol, key


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["off", "on"])
def test_the_plan_auto_weighs_is_the_whole_run(backend, mode):
    """``planned_memory`` counts what the built run holds beside the step's own arena
    (the eval program's arena, copies and scratch): within 10% of the built estimate, so
    ``AUTO_SHARE`` is a share of the run, not of the step alone."""
    from gradtape.train.memory import estimate

    model = tiny_model(seed=2, n_layers=4)
    ts = TrainStep(model, init_adapter(model.config, 4, 8.0, seed=1), 2, 64,
                   backend=backend, grad_checkpoint=mode, compute="float32")
    plan, built = ts.planned_memory(ts.checkpointed), estimate(model, ts)
    assert abs(plan.activations - built.activations) <= 0.1 * built.activations
    assert ts.eval_program.memory.nbytes > 0.1 * built.activations  # it is counted
    assert (plan.weights, plan.scratch, plan.state) == (built.weights, built.scratch,
                                                        built.state)


def test_auto_checkpoints_only_when_needed_and_refuses_what_never_fits():
    model = tiny_model(seed=2, n_layers=4)
    t = 64

    def step(mode, limit):
        return TrainStep(model, init_adapter(model.config, 4, 8.0, seed=1), 2, t,
                         grad_checkpoint=mode, memory_limit=limit)

    probe = step("off", None)
    need_off, need_on = (probe.planned_memory(c).total for c in (False, True))
    assert need_on < need_off
    share = AUTO_SHARE
    assert not step("auto", need_off / share).checkpointed  # fits as it is, with room
    # would take over the share: recomputes some layers, all where only that fits
    assert 1 <= step("auto", need_off / share - 1).checkpointed <= 4
    assert step("auto", need_on / share).checkpointed == 4
    # "fit" makes the same choices where only the memory available decides
    assert not step("fit", need_off / share).checkpointed
    tight = step("fit", need_off / share - 1)
    assert 1 <= tight.checkpointed <= 4
    assert tight.plan.checkpoint.why.endswith("(--grad-checkpoint fit: the run within 3/4 "
                                              "of the memory available)")
    assert step("fit", need_on / share).checkpointed == 4
    assert not step("fit", None).checkpointed
    assert step("on", None).checkpointed == 4
    with pytest.raises(GradtapeError, match=r"not enough memory: this run needs about "
                                            r"[\d.]+ GiB \(weights .*activations .*\) with "
                                            r"activation checkpointing, but only 0\.4 GiB "
                                            r"is available: use a shorter --seq-len"):
        step("auto", need_on - 1)
    with pytest.raises(GradtapeError, match=r"without activation checkpointing.*"
                                            r"\(--grad-checkpoint on would need less\): use a shorter"):
        step("off", need_off - 1)
    with pytest.raises(GradtapeError, match=r"not enough memory: .* with activation "
                                            r"checkpointing"):
        step("fit", need_on - 1)
    with pytest.raises(ValueError, match=r"grad_checkpoint must be one of \('auto', 'fit', "
                                         r"'on', 'off'\)"):
        step("sometimes", None)


def test_recompute_pays_weighs_memory_freed_against_work_added():
    """``auto`` recomputes every layer, fitting or not, where that frees a quarter of the
    run or more (or any, beside a trained state of half the run or more) at >= 1 MB per
    GFLOP recomputed; not where it frees less, or costs more."""
    from gradtape.train.memory import Estimate
    from gradtape.train.step import recompute_pays

    MB, GF = 1 << 20, 10**9
    off = Estimate(weights=300 * MB, activations=500 * MB, scratch=0, state=0,
                   overhead=400 * MB, flops=250 * GF)  # 1200 MB
    assert recompute_pays(off, dataclasses.replace(off, activations=80 * MB, flops=344 * GF))
    # frees a sixth of the run only (256 rows beside the same weights)
    assert not recompute_pays(off, dataclasses.replace(off, activations=300 * MB,
                                                       flops=300 * GF))
    # frees enough, but 0.4 MB per GFLOP (an 8B model's layers)
    assert not recompute_pays(off, dataclasses.replace(off, activations=80 * MB,
                                                       flops=1300 * GF))
    # a sixth freed, but beside a trained state that is most of the run (full
    # fine-tuning's params and moments): every layer, where it pays per GFLOP
    full = dataclasses.replace(off, state=1600 * MB)
    assert recompute_pays(full, dataclasses.replace(full, activations=300 * MB,
                                                    flops=300 * GF))
    assert not recompute_pays(full, dataclasses.replace(full, activations=300 * MB,
                                                        flops=600 * GF))
    assert not recompute_pays(full, full)  # frees nothing


def test_auto_recomputes_every_layer_where_that_pays(monkeypatch):
    """No memory limit: the tiny model's activations are a small share beside the runtime,
    so ``auto`` keeps them; where the trade is made to pay, every layer is recomputed.
    ``fit`` makes no such trade: it recomputes only to fit the memory available."""
    from gradtape.train import step as S

    model = tiny_model(seed=2, n_layers=4)

    def step(mode="auto", limit=None):
        return TrainStep(model, init_adapter(model.config, 4, 8.0, seed=1), 2, 64,
                         grad_checkpoint=mode, memory_limit=limit)

    assert step().checkpointed == 0
    monkeypatch.setattr(S, "AUTO_FREES", 0.0)
    monkeypatch.setattr(S, "AUTO_MB_PER_GFLOP", 0.0)
    assert step().checkpointed == 4
    need_off = step("off").planned_memory(0).total
    roomy = need_off / AUTO_SHARE
    auto = step("auto", roomy)
    assert auto.checkpointed == 4  # and it says what fit would do
    assert auto.plan.checkpoint.why.endswith(
        f"; --grad-checkpoint fit would recompute none, in about {need_off / 2**30:.1f} GiB, "
        "for faster steps)")
    assert "fit would" not in step("auto", roomy - 1).plan.checkpoint.why  # it would not fit
    fit = step("fit", roomy)
    assert fit.checkpointed == 0
    assert fit.plan.checkpoint.why == "0 of 4 layers recomputed (--grad-checkpoint fit)"


def test_auto_beside_a_large_state_recomputes_the_fewest_layers_that_free_as_much(
        monkeypatch):
    """Where the trained state counts as most of the run (here made so), ``auto``
    recomputes as few layers as give all layers' plan (within 1 MB), and says so."""
    from gradtape.train import step as S

    model = tiny_model(seed=2, n_layers=4)
    monkeypatch.setattr(S, "AUTO_STATE", 0.0)
    monkeypatch.setattr(S, "AUTO_MB_PER_GFLOP", 0.0)
    st = TrainStep(model, None, 2, 64, fine_tune_type="full", grad_checkpoint="auto")
    n, layers = st.checkpointed, model.config.n_layers
    assert 0 < n <= layers
    assert st.planned_memory(n).total <= st.planned_memory(layers).total + 2**20
    if n < layers:
        assert "the fewest layers that free as much" in st.plan.checkpoint.why
