"""A Ctrl-C in the middle of a run: ``TrainStep.step`` interrupted at a chosen call."""

from __future__ import annotations

import contextlib

import pytest

from gradtape.train.step import TrainStep


@contextlib.contextmanager
def killed_at_step(monkeypatch, n):
    """Inside the block ``TrainStep.step`` raises ``KeyboardInterrupt`` at its ``n``-th
    call, which must end the block; the real step is back afterwards."""
    real, calls = TrainStep.step, [0]

    def dying(self, *a, **k):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(TrainStep, "step", dying)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        monkeypatch.setattr(TrainStep, "step", real)
