"""The memory estimate of a fine-tuning run and its check before training starts; the
choice of keeping frozen weights in their stored type (``--weights``).  The machine's
MemAvailable is replaced by ``$GRADTAPE_MEM_AVAILABLE`` so that the tests do not depend
on it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradtape import llama
from gradtape.errors import GradtapeError
from gradtape.models.memory import weight_bytes
from gradtape.ops import PRIMS
from gradtape.train.finetune import FinetuneConfig, finetune
from gradtape.train.memory import OVERHEAD, estimate
from gradtape.train.step import TrainStep
from gradtape.models.lora import init_adapter

from support import hardware
from support.filebuilders import write_tiny_gguf
from support.tinymodel import tiny_model
from support.interrupt import killed_at_step

TEXT = "pack my box with five dozen liquor jugs. " * 40


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mem")
    m = tiny_model(seed=3, dim=64, ffn_dim=128, vocab=258)
    write_tiny_gguf(m, root / "tiny-q8.gguf", qtype="Q8_0")
    (root / "text.txt").write_text(TEXT)
    return root


def _cfg(files, out, **kw):
    base = dict(model=str(files / "tiny-q8.gguf"), data=str(files / "text.txt"), out=str(out),
                steps=2, seq_len=16, batch_size=2, rank=2, eval_every=0, save_every=10,
                progress=False, backend="cpu")
    base.update(kw)
    return FinetuneConfig(**base)


def test_weight_bytes_from_the_header(files):
    path = files / "tiny-q8.gguf"
    f32 = llama.load(path)
    q8 = llama.load(path, keep_quantized=True)
    assert weight_bytes(path) == sum(w.nbytes for w in f32.weights.values())
    assert weight_bytes(path, keep_quantized=True) == sum(w.nbytes for w in q8.weights.values()) \
        + sum(w.nbytes for k, w in q8.weights.items() if k.endswith((".q", ".k")))


def test_estimate_counts_plans_weights_and_scratch(files, monkeypatch):
    from gradtape.models import graph as M

    monkeypatch.setattr(M, "ATTN_TILED_MIN", 0)  # the tiled attention at these short rows
    model = llama.load(files / "tiny-q8.gguf", keep_quantized=True)
    adapter = init_adapter(model.config, 2, 4.0, seed=0)
    step = TrainStep(model, adapter, 2, 16, backend="cpu", compute="float32")
    est = estimate(model, step)
    assert est.weights == sum(w.nbytes for w in model.weights.values())
    # the step and eval programs share one arena (``SharedArena``): the larger plan's
    assert est.activations == max(step.program.memory.nbytes, step.eval_program.memory.nbytes)
    # the dequantization tile, plus the largest scratch of a tiled op (attention's tiles)
    fused = max(PRIMS[v.op].scratch(v) * 4 for v in step.program.graph.ops
                if PRIMS[v.op].scratch is not None)
    assert fused > 0
    assert est.scratch == step.program.executable._tile_scratch.nbytes + fused > fused
    assert est.total == est.weights + est.activations + est.scratch + est.state + OVERHEAD
    assert "GiB (weights" in est.describe()


def test_estimate_counts_the_bf16_weight_copies(files, monkeypatch):
    from gradtape.backends.cpu import backend as cpu, measure as compute

    hardware.onednn_bf16()
    monkeypatch.setattr(cpu, "BF16_MIN_WEIGHT", 0)  # the tiny weights in bf16 GEMMs too,
    monkeypatch.setattr(compute, "bf16_fast", lambda shape: (True, ""))  # measured or not
    model = llama.load(files / "tiny-q8.gguf")
    adapter = init_adapter(model.config, 2, 4.0, seed=0)
    step = TrainStep(model, adapter, 2, 16, backend="cpu", compute="bf16")
    copies = {id(a): a.nbytes for p in (step.program, step.eval_program)
              for a in p.executable.bf16_weights()}
    assert copies  # a copy of each frozen weight, or two packs of it
    est = estimate(model, step)
    assert est.weights == sum(w.nbytes for w in model.weights.values()) + sum(copies.values())


def test_a_bf16_step_on_block_weights_keeps_one_bf16_copy_of_each(files, monkeypatch):
    """Where the plan leaves room, each block weight of a bf16 step is read from a bf16
    copy made once (the tiles' very values), which the step's programs share and the
    estimate counts; the float32 copy is never made."""
    from gradtape import plan
    from gradtape.backends.cpu import measure as compute

    hardware.onednn_bf16()
    monkeypatch.setattr(compute, "bf16_fast", lambda shape: (True, ""))
    monkeypatch.setattr(compute, "fastest",  # the resident way wherever it is offered
                        lambda what, shape, runs, only=((), ""):
                        next((n for n in runs if n.split()[0] == "resident"),
                             next(iter(runs))))
    model = llama.load(files / "tiny-q8.gguf", keep_quantized=True)
    adapter = init_adapter(model.config, 2, 4.0, seed=0)
    step = TrainStep(model, adapter, 2, 16, backend="cpu", compute="bf16")
    assert step.plan.resident_weights.value and "bf16 copies" in step.plan.describe()
    copies = {id(a): a for p in (step.program, step.eval_program)
              for a in p.executable.bf16_weights()}
    # one for each block weight a bf16 product reads (not the embedding, only gathered
    # from), shared by the two programs
    read = {s.inputs[1] for p in (step.program, step.eval_program)
            for s in p.executable._block_bf16}
    assert len(read) == len(copies) > 0
    assert sorted(a.nbytes for a in copies.values()) == sorted(
        2 * w.attrs["logical"][0] * w.attrs["logical"][1] for w in read)
    est = estimate(model, step)
    assert est.weights == (sum(w.nbytes for w in model.weights.values())
                           + sum(a.nbytes for a in copies.values()))
    # too little memory for them: the tiles are dequantized at every step instead
    small = plan.resident_weights(plan.for_program("cpu", "bf16"), 1 << 30, 1 << 31)
    assert not small.resident_weights.value and "would not fit" in small.resident_weights.why


def test_auto_weights_keep_a_ggufs_blocks_where_its_products_run_bf16(files, tmp_path,
                                                                       monkeypatch):
    """``--weights auto`` on a GGUF: its blocks stay where the plan runs the products in
    bf16 (they read bf16 copies of them), a float32 copy is loaded where they run in
    float32."""
    from gradtape.backends.cpu import backend as cpu, measure as compute

    hardware.onednn_bf16()
    monkeypatch.setattr(cpu, "BF16_MIN_WEIGHT", 0)
    for fast in (True, False):
        monkeypatch.setattr(compute, "bf16_fast", lambda shape: (fast, "forced"))
        logs = []
        s = finetune(_cfg(files, tmp_path / f"run-{fast}", compute="auto"), log=logs.append)
        assert s["steps"] == 2
        kept = [line for line in logs if "weights: kept in their stored type (the bf16" in line]
        assert bool(kept) == fast, logs


def test_not_enough_memory_is_one_clear_error_before_training(files, tmp_path, monkeypatch):
    monkeypatch.setenv("GRADTAPE_MEM_AVAILABLE", str(200 << 20))  # less than the runtime
    logs = []
    with pytest.raises(GradtapeError, match=r"not enough memory: this run needs about "
                                            r"[\d.]+ GiB \(weights .*runtime 0\.39\) with "
                                            r"activation checkpointing, but only 0\.2 GiB is "
                                            r"available: use a shorter --seq-len"):
        finetune(_cfg(files, tmp_path / "run"), log=logs.append)
    assert not (tmp_path / "run" / "log.jsonl").exists()  # nothing ran
    # --ignore-memory starts anyway
    s = finetune(_cfg(files, tmp_path / "run2", ignore_memory=True), log=logs.append)
    assert s["steps"] == 2


def test_float32_that_does_not_fit_is_refused_before_loading(files, tmp_path, monkeypatch):
    path = files / "tiny-q8.gguf"
    f32 = weight_bytes(path)
    monkeypatch.setenv("GRADTAPE_MEM_AVAILABLE", str(f32 + OVERHEAD - 1))
    with pytest.raises(GradtapeError, match=r"the float32 weights of .*tiny-q8.gguf take .* "
                                            r"--weights stored keeps them in the file's type"):
        finetune(_cfg(files, tmp_path / "run", weights="float32"), log=lambda *a: None)


def test_loading_float_weights_that_do_not_fit_is_one_error(files, monkeypatch):
    """llama.load refuses float32 (or float64) copies larger than the memory available,
    before allocating them, and names keep_quantized=True; kept stored, or with
    check_memory=False, it loads."""
    path = files / "tiny-q8.gguf"
    f32 = weight_bytes(path)
    monkeypatch.setenv("GRADTAPE_MEM_AVAILABLE", str(f32 - 1))
    with pytest.raises(GradtapeError, match=r"not enough memory: the float32 weights of "
                                            r".*tiny-q8.gguf take .* load\(\.\.\., "
                                            r"keep_quantized=True\) keeps them"):
        llama.load(path)
    assert llama.load(path, keep_quantized=True).config.dim == 64
    assert llama.load(path, check_memory=False).config.dim == 64
    monkeypatch.setenv("GRADTAPE_MEM_AVAILABLE", str(f32 + 1))
    assert llama.load(path).config.dim == 64
    with pytest.raises(GradtapeError, match="the float64 weights"):
        llama.load(path, dtype=np.float64)


def test_auto_keeps_stored_weights_when_float32_would_not_fit(files, tmp_path, monkeypatch):
    monkeypatch.setenv("GRADTAPE_MEM_AVAILABLE", str(int(1.1 * OVERHEAD)))
    logs = []
    # float32 GEMMs both times: `auto` times bf16 at this tiny shape, and a noisy
    # measurement would put only the stored weights' tiles in bf16
    s = finetune(_cfg(files, tmp_path / "auto", compute="float32"), log=logs.append)
    assert any("keeping them in their stored type" in line for line in logs)
    assert any(line.startswith("memory: this run needs about") for line in logs)
    # the same run with float32 weights ends with (nearly) the same adapter
    monkeypatch.delenv("GRADTAPE_MEM_AVAILABLE")
    r = finetune(_cfg(files, tmp_path / "f32", weights="float32", compute="float32"),
                 log=lambda *a: None)
    a = llama.load_adapter(tmp_path / "auto" / "adapter")
    b = llama.load_adapter(tmp_path / "f32" / "adapter")
    for key in a.weights:
        for x, y in zip(a.weights[key], b.weights[key]):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    assert abs(s["final_loss"] - r["final_loss"]) <= 1e-5 * abs(r["final_loss"])
    cfgs = json.loads((tmp_path / "auto" / "gradtape-run.json").read_text())["config"]
    assert cfgs["weights"] == "auto"


def test_int8_compute_keeps_the_weights_stored(files, tmp_path):
    """--compute int8 computes from the file's blocks: --weights auto keeps them, and
    says so (whichever precision this CPU then runs)."""
    import warnings

    logs = []
    with warnings.catch_warnings():  # int8 may not be faster at this tiny shape: a notice
        warnings.simplefilter("ignore", RuntimeWarning)
        finetune(_cfg(files, tmp_path / "run", compute="int8"), log=logs.append)
    assert "weights: kept in their stored type (--compute int8 computes from the file's " \
           "blocks)" in logs


def test_an_int8_run_resumes_bit_for_bit(files, tmp_path, monkeypatch):
    """An int8 step is deterministic (exact integer sums; scales from maxima, whatever
    the threads' order): a run stopped after its checkpoint and resumed ends with the
    adapter of the run never stopped, bit for bit.  int8 is forced here, whatever this
    CPU measures at the tiny shape."""
    from gradtape import plan

    hardware.onednn_bf16()
    hardware.int8_dots()
    monkeypatch.setattr(plan, "decide_compute", lambda *a, **k: plan.Decision("int8", "forced"))
    cfg = lambda out, **kw: _cfg(files, tmp_path / out, compute="int8", steps=4,  # noqa: E731
                                 save_every=2, **kw)
    logs = []
    finetune(cfg("full"), log=logs.append)
    assert "compute: int8 (forced)" in logs
    with killed_at_step(monkeypatch, 4):  # after the checkpoint of step 2 and one step more
        finetune(cfg("split"), log=lambda *a: None)
    finetune(cfg("split", resume=True), log=lambda *a: None)
    a = llama.load_adapter(tmp_path / "full" / "adapter")
    b = llama.load_adapter(tmp_path / "split" / "adapter")
    for key in a.weights:
        for x, y in zip(a.weights[key], b.weights[key]):
            np.testing.assert_array_equal(x, y)
