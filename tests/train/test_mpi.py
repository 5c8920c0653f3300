"""Data-parallel training with MPI: ``mpiexec -n 2`` (loopback) on a tiny model equals one
process with twice the batch; only rank 0 writes; the split (grads -> Allreduce -> update)
step equals the fused one in-process; launcher detection and its errors."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from gradtape.train import distributed
from gradtape.models.lora import init_adapter, load_adapter, parse_targets
from gradtape.train.step import TrainStep

from support.mpi import MPIEXEC, mpi_env as _env
from support.tinymodel import tiny_model

STEPS = 6


@pytest.fixture
def mpi():
    """``make test`` installs mpi4py and mpiexec (the mpich wheel): missing, a test fails."""
    assert MPIEXEC is not None, "mpiexec / mpi4py not installed (pip install '.[mpi]')"


needs_mpi = pytest.mark.usefixtures("mpi")


def _finetune(tiny_dir, out, batch, *extra, ranks=0, steps=STEPS, popen=False):
    cmd = [sys.executable, "-m", "gradtape.cli", "finetune", "--model", str(tiny_dir / "model"),
           "--data", str(tiny_dir / "text.txt"), "--out", str(out), "--steps", str(steps),
           "--seq-len", "32", "--batch-size", str(batch), "--grad-accum", "2", "--rank", "4",
           "--lr", "1e-2", "--warmup", "2", "--save-every", "2", "--eval-every", "3",
           "--dtype", "float64", *extra]
    if ranks:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env())
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())


def _max_rel(a, b):
    """max over tensors of ||a - b|| / ||b||."""
    worst = 0.0
    for key in b.weights:
        for x, y in zip(a.weights[key], b.weights[key]):
            worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-300)))
    return worst


@pytest.mark.slow
@needs_mpi
def test_two_ranks_equal_one_process_with_twice_the_batch(tiny_dir, tmp_path):
    one = _finetune(tiny_dir, tmp_path / "one", 4)
    assert one.returncode == 0, one.stderr
    two = _finetune(tiny_dir, tmp_path / "two", 2, ranks=2)
    assert two.returncode == 0, two.stdout + two.stderr
    a, b = load_adapter(tmp_path / "two" / "adapter"), load_adapter(tmp_path / "one" / "adapter")
    B = b.weights[next(iter(b.weights))][1]
    assert np.abs(B).max() > 1e-3  # it trained
    assert _max_rel(a, b) < 1e-6  # the saved adapter is float32
    # the float64 state of the last step: adapter params and AdamW moments
    sa, sb = (load_file(tmp_path / run / "checkpoint" / "state.safetensors")
              for run in ("two", "one"))
    assert sa.keys() == sb.keys() and sa["param.0"].dtype == np.float64
    err = max(float(np.linalg.norm(sa[k] - sb[k]) / max(np.linalg.norm(sb[k]), 1e-300))
              for k in sb if k.startswith("param."))
    print(f"2 ranks x batch 2 vs 1 process x batch 4, float64, {STEPS} steps: max relative "
          f"adapter difference {err:.2e}")
    assert err < 1e-12
    # only rank 0 wrote and spoke: every step logged once, one summary line
    log = [json.loads(x) for x in (tmp_path / "two" / "log.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    for r, q in zip(log, ref):  # the all-reduced loss is the global step's mean loss
        assert r["loss"] == pytest.approx(q["loss"], rel=1e-12)
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-12)
        assert ("eval_loss" in r) == ("eval_loss" in q)
    assert two.stdout.count("final train loss") == 1
    assert two.stdout.count("training ") == 1
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir())
    # checkpoints move between rank counts when the global batch stays: the 2-rank run
    # continues in one process with batch 4, the 1-process run on 2 ranks with batch 2
    more = ("--steps", str(STEPS + 2), "--resume")
    for res in (_finetune(tiny_dir, tmp_path / "two", 4, *more),
                _finetune(tiny_dir, tmp_path / "one", 2, *more, ranks=2)):
        assert res.returncode == 0, res.stdout + res.stderr
    sa, sb = (load_file(tmp_path / run / "checkpoint" / "state.safetensors")
              for run in ("two", "one"))
    assert max(float(np.linalg.norm(sa[k] - sb[k]) / np.linalg.norm(sb[k]))
               for k in sb if k.startswith("param.")) < 1e-12
    bad = _finetune(tiny_dir, tmp_path / "one", 2, *more)
    assert bad.returncode == 1 and "keep their product" in bad.stderr, bad.stderr


@pytest.mark.slow
@needs_mpi
def test_ctrl_c_stops_every_rank_after_the_same_step_and_resumes(tiny_dir, tmp_path):
    steps = 40
    full = _finetune(tiny_dir, tmp_path / "full", 2, ranks=2, steps=steps)
    assert full.returncode == 0, full.stderr
    out = tmp_path / "cut"
    proc = _finetune(tiny_dir, out, 2, ranks=2, steps=steps, popen=True)
    deadline = time.time() + 60
    while _lines(out / "log.jsonl") < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C on mpiexec does; it forwards it to the ranks
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    done = _lines(out / "log.jsonl")
    assert 3 <= done < steps and f"checkpoint at step {done} saved" in stdout
    res = _finetune(tiny_dir, out, 2, "--resume", ranks=2, steps=steps)
    assert res.returncode == 0, res.stderr
    sa, sb = (load_file(tmp_path / run / "checkpoint" / "state.safetensors")
              for run in ("cut", "full"))
    for k in sb:  # same ranks, same shards: bitwise
        assert np.array_equal(sa[k], sb[k]), k


def _lines(path):
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.slow
@needs_mpi
def test_a_setup_error_stops_every_rank_with_one_line(tiny_dir, tmp_path):
    res = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "gradtape.cli", "finetune", "--model",
         str(tiny_dir / "model"), "--data", str(tmp_path / "missing.txt"), "--out",
         str(tmp_path / "out")], capture_output=True, text=True, timeout=60, env=_env())
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if "error" in x]
    assert len(lines) == 1 and "does not exist" in lines[0], res.stderr


def test_mpiexec_without_mpi4py_is_a_clear_error(tiny_dir, tmp_path):
    stub = tmp_path / "stub" / "mpi4py"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('no mpi4py here')\n")
    env = dict(_env(), PMI_RANK="0", PMI_SIZE="2",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "stub"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "gradtape.cli", "finetune", "--model",
                          str(tiny_dir / "model"), "--data", str(tiny_dir / "text.txt"),
                          "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 1
    assert "mpi4py is not installed" in res.stderr and "gradtape[mpi]" in res.stderr
    assert "Traceback" not in res.stderr


def test_launcher_detection():
    assert distributed.launched_size({}) is None
    assert distributed.launched_size({"HOME": "/"}) is None
    assert distributed.launched_size({"PMI_RANK": "1", "PMI_SIZE": "4"}) == 4
    assert distributed.launched_size({"OMPI_COMM_WORLD_SIZE": "3"}) == 3
    assert distributed.launched_size({"MPI_LOCALNRANKS": "2"}) == 0


def test_single_process_never_imports_mpi4py():
    code = ("import sys, gradtape.train.finetune as f; from gradtape.train import distributed;"
            "w = distributed.world(); assert w.size == 1 and w.rank == 0;"
            "assert 'mpi4py' not in sys.modules")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=_env())
    assert res.returncode == 0, res.stderr


class _Pretend(distributed.World):
    """Two ranks' worth of machinery in one process: the 'sum' over one rank is itself."""

    size = 2


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_split_step_equals_fused_step(grad_accum):
    model = tiny_model(seed=2)
    T, B = 16, 2
    rng = np.random.default_rng(0)
    steps = []
    for kind in (None, _Pretend()):
        ad = init_adapter(model.config, 4, 8.0, parse_targets("q,v,down"), seed=1,
                          base_model="tiny", dtype=np.float64)
        steps.append(TrainStep(model, ad, B, T, grad_accum=grad_accum, dtype=np.float64,
                               clip=0.5, world=kind))
    fused, split = steps
    assert split.world is not None and fused.world is None
    for s in range(4):
        micro = []
        for _ in range(grad_accum):
            ids = rng.integers(0, 256, (B, T))
            tg = np.where(rng.random((B, T)) < 0.8, rng.integers(0, 256, (B, T)), -100)
            micro.append((ids, tg))
        lf, nf = fused.step(micro, s + 1, 1e-2)
        ls, ns = split.step(micro, s + 1, 1e-2)
        assert ls == pytest.approx(lf, rel=1e-13) and ns == pytest.approx(nf, rel=1e-13)
    for key, (a, b) in fused.adapter_weights().items():
        a2, b2 = split.adapter_weights()[key]
        np.testing.assert_allclose(a2, a, rtol=1e-6, atol=0)  # float32 copies
        np.testing.assert_allclose(b2, b, rtol=1e-6, atol=0)
    sa, sf = split.state_arrays(), fused.state_arrays()
    assert sa.keys() == sf.keys()  # checkpoints are interchangeable
    for k in sf:
        np.testing.assert_allclose(sa[k], sf[k], rtol=1e-12, atol=1e-300)
    # and a fused checkpoint loads into the split step (grads program sees the params)
    split.load_state_arrays(sf)
    micro = [(np.arange(B * T).reshape(B, T) % 256, np.arange(B * T).reshape(B, T) % 256)] * grad_accum
    assert split.step(micro, 5, 1e-2)[0] == pytest.approx(fused.step(micro, 5, 1e-2)[0], rel=1e-12)
