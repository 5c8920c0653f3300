"""Packing examples into rows (``data.pack_rows``) without cross-talk: the best-fit layout,
and every packed example's loss and adapter gradient equal to the same example trained
alone (float64, 1e-12), through the graph and through the compiled training step; rows of
one example compute exactly what the graph computed before packing existed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import gradtape as gt
from gradtape.train import data as data_mod
from gradtape.train.step import TrainStep

from support.adapters import random_adapter
from support.tinymodel import lora_loss_outputs, tiny_model


def _examples(lengths, seed=0):
    """Random examples of these lengths, about two thirds of their tokens targets."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, n).astype(np.int64), rng.random(n) < 0.7) for n in lengths]


def _place(rows, ids):
    """(row, columns) where the example ``ids`` lies in packed ``rows``."""
    for r in range(len(rows)):
        for s in np.unique(rows.segments[r]):
            cols = np.nonzero(rows.segments[r] == s)[0]
            if len(cols) == len(ids) and (rows.ids[r, cols] == ids).all():
                return r, cols
    raise AssertionError("example not found in the packed rows")


def _rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def test_best_fit_decreasing():
    # longest first, each into the row it fills most tightly: [5, 3] and [4, 3] in rows
    # of 8, the padding after them a segment of its own
    rows = data_mod.pack_rows(_examples([3, 5, 4, 3]), 8, pad_id=0)
    assert rows.segments.tolist() == [[0] * 5 + [1] * 3, [0] * 4 + [1] * 3 + [2]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 0]]
    assert rows.targets[1, -1] == data_mod.IGNORE  # padding is never a target


def test_every_example_is_packed_once_and_intact():
    lengths = np.random.default_rng(1).integers(2, 65, 300)
    examples = _examples(lengths, seed=1)
    rows = data_mod.pack_rows(examples, 64, pad_id=0)
    for ids, mask in examples:
        r, cols = _place(rows, ids)
        assert (np.diff(cols) == 1).all() and rows.positions[r, cols].tolist() == list(range(len(ids)))
        assert (rows.targets[r, cols] == data_mod._targets(ids, mask)).all()
    assert rows.n_target_tokens == sum(int(m[1:].sum()) for _, m in examples)
    assert len(rows) <= 1.05 * lengths.sum() / 64 + 1  # about as full as rows can be
    again = data_mod.pack_rows(examples, 64, pad_id=0)  # a pure function of the examples
    assert all(np.array_equal(getattr(rows, f), getattr(again, f))
               for f in ("ids", "targets", "positions", "segments"))


# the graph's features that packing touches: rope (per layer, or none: SmolLM3's NoPE
# layers), sliding windows with their own rope base (Gemma 3), soft-capped scores (Gemma 2)
FEATURES = {"llama": {}, "sliding window": {"sliding_window": 5},
            "gemma3-like": {"sliding_window": 5, "sliding_layers": (0,),
                            "rope_local_base": 1000.0},
            "smollm3-like": {"nope_layers": (1,)}, "softcap": {"attn_softcap": 3.0}}


@pytest.mark.parametrize("features", list(FEATURES))
def test_packed_examples_equal_each_alone(features):
    m = tiny_model()
    cfg = dataclasses.replace(m.config, **FEATURES[features])
    ad = random_adapter(m.config)
    examples = _examples([9, 7, 5, 12, 3, 6])
    rows = data_mod.pack_rows(examples, 16, pad_id=256)
    assert len(rows) == 3 and (rows.segments.max(axis=1) >= 1).all()  # all rows shared
    for ids, mask in examples:
        alone, _ = lora_loss_outputs(gt.Tape(np.float64), cfg, m.weights, ad, ids[None],
                                     data_mod._targets(ids, mask)[None])
        r, cols = _place(rows, ids)
        targets = np.full(rows.targets.shape, data_mod.IGNORE)  # this example's loss only
        targets[r, cols] = rows.targets[r, cols]
        packed, _ = lora_loss_outputs(gt.Tape(np.float64), cfg, m.weights, ad, rows.ids,
                                      targets, rows.positions, rows.segments)
        for a, p in zip(alone, packed):
            assert _rel(p.value, a.value) <= 1e-12


def test_rows_of_one_example_compute_what_they_did_before_packing():
    m = tiny_model()
    ad = random_adapter(m.config)
    rng = np.random.default_rng(2)
    ids, targets = rng.integers(0, 256, (3, 16)), rng.integers(0, 256, (3, 16))
    before, _ = lora_loss_outputs(gt.Tape(np.float64), m.config, m.weights, ad, ids, targets)
    rows = data_mod.empty_rows(3, 16)
    now, _ = lora_loss_outputs(gt.Tape(np.float64), m.config, m.weights, ad, ids, targets,
                               rows.positions, rows.segments)
    for b, n in zip(before, now):  # bit for bit
        assert np.array_equal(b.value, n.value)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_a_packed_step_is_the_padded_step(backend):
    """The same examples, padded one a row or packed: the same loss, gradient norm and
    adapter after three AdamW steps (the token-weighted mean is the same sum)."""
    m = tiny_model()
    examples = _examples([9, 7, 5, 12, 3, 6, 10, 4])
    padded = data_mod.pad_rows(examples, 16, pad_id=256)
    packed = data_mod.pack_rows(examples, 16, pad_id=256)
    assert len(packed) < len(padded)
    steps = [TrainStep(m, random_adapter(m.config), len(rows), 16, dtype=np.float64, backend=backend)
             for rows in (padded, packed)]
    for step in (1, 2, 3):
        (l1, n1), (l2, n2) = (st.step([rows.batch(slice(None))], step, 1e-2)
                              for st, rows in zip(steps, (padded, packed)))
        assert abs(l2 - l1) <= 1e-12 * abs(l1) and abs(n2 - n1) <= 1e-12 * abs(n1)
    for p1, p2 in zip(*(st.current_params().values() for st in steps)):  # float64
        assert _rel(p2, p1) <= 1e-12
    assert abs(steps[1].eval_loss(packed) - steps[0].eval_loss(padded)) <= 1e-12
