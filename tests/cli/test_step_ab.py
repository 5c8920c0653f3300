"""bench/step_ab.py: its settings, and that each step is built under its own setting with
the environment put back after (the A/B tool behind docs/benchmarks.md's tile sizes)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "step_ab.py"


@pytest.fixture
def ab():
    spec = importlib.util.spec_from_file_location("step_ab", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_settings_are_name_value_pairs_or_a_dash(ab):
    assert ab.parse_setting("-") == {}
    assert ab.parse_setting("A=1,B=x=y") == {"A": "1", "B": "x=y"}
    for bad in ("A", "=1", "A=1,"):
        with pytest.raises(SystemExit, match="NAME=VALUE"):
            ab.parse_setting(bad)


def test_each_step_is_built_under_its_setting_and_the_environment_put_back(ab, monkeypatch):
    seen = []

    class Step:
        def __init__(self, *a, **kw):
            seen.append(os.environ.get("GRADTAPE_BF16_TILE"))

        def step(self, data, i, lr):
            seen.append(("step", os.environ.get("GRADTAPE_BF16_TILE")))

    monkeypatch.setattr(ab, "TrainStep", Step)
    monkeypatch.setattr(ab, "init_adapter", lambda *a, **kw: None)
    monkeypatch.setenv("GRADTAPE_BF16_TILE", "16M")
    args = SimpleNamespace(rank=8, batch=1, seq_len=4, compute="auto")
    model = SimpleNamespace(config=None)
    ab.build(model, {"GRADTAPE_BF16_TILE": "1M"}, args, [])
    assert seen == ["1M", ("step", "1M")] and os.environ["GRADTAPE_BF16_TILE"] == "16M"
    monkeypatch.delenv("GRADTAPE_BF16_TILE")
    ab.build(model, {"GRADTAPE_BF16_TILE": "1M"}, args, [])
    assert "GRADTAPE_BF16_TILE" not in os.environ


def test_checkpointing_choices_get_the_memory_available_as_finetune_gives_it(ab, monkeypatch):
    kwargs = []

    class Step:
        plan = SimpleNamespace(checkpoint=SimpleNamespace(why="0 of 2 layers recomputed"))

        def __init__(self, *a, **kw):
            kwargs.append((kw["grad_checkpoint"], kw["memory_limit"]))

        def step(self, data, i, lr):
            pass

    monkeypatch.setattr(ab, "TrainStep", Step)
    monkeypatch.setattr(ab, "init_adapter", lambda *a, **kw: None)
    monkeypatch.setattr(ab, "mem_available", lambda: 123)
    args = SimpleNamespace(rank=8, batch=1, seq_len=4, compute="auto")
    for gc in ("off", "on", "auto", "fit"):
        ab.build(SimpleNamespace(config=None), {}, args, [], checkpoint=gc)
    assert kwargs == [("off", None), ("on", None), ("auto", 123), ("fit", 123)]
    with pytest.raises(SystemExit, match="--grad-checkpoints takes auto,fit,on,off, got "
                                         r"\['auto', 'sometimes'\]"):
        ab.main(["--grad-checkpoints", "auto,sometimes", "-"])
