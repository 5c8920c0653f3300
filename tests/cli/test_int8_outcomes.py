"""bench/int8_outcomes.py and its instruction set (examples/instructions): the data reads
as Alpaca records and is what make_data.py makes; the options' checks; which runs are
reused, resumed or started over; the verdict against float32's seeds; and a tiny run end
to end on the real model (the full benchmark is for a quiet machine)."""

from __future__ import annotations

import dataclasses
import json
import runpy
from pathlib import Path

import pytest

from gradtape.errors import GradtapeError
from gradtape.train import data as data_mod

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "int8_outcomes.py"
INSTRUCTIONS = ROOT / "examples" / "instructions"


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(SCRIPT))


def test_instruction_set_is_what_make_data_makes():
    made = runpy.run_path(str(INSTRUCTIONS / "make_data.py"))["rows"]()
    train = [json.loads(x) for x in (INSTRUCTIONS / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (INSTRUCTIONS / "test.jsonl").read_text().splitlines()]
    assert (len(train), len(test)) == (360, 40)
    assert train + test == made
    questions = {(r["instruction"], r.get("input", "")) for r in made}
    assert len(questions) == len(made)  # no held-out question is also trained on


@pytest.mark.parametrize("split", ["train", "test"])
def test_instruction_set_reads_as_alpaca(split):
    d = data_mod.read_data(str(INSTRUCTIONS / f"{split}.jsonl"), "--data", "")
    assert "Alpaca" in d.describe()


@pytest.mark.parametrize("argv, message", [
    (["--computes", "float32,fp8"], "--computes: unknown 'fp8'"),
    (["--computes", "int8,int8"], "--computes: 'int8,int8' names one twice"),
    (["--data", "alpaca"], "--data: unknown 'alpaca'"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--seeds", "0"], "--seeds must be >= 1, got 0"),
    (["--eval-every", "0"], "--eval-every must be >= 1, got 0"),
    (["--seq-len", "1"], "--seq-len must be >= 2, got 1"),
])
def test_bad_options_are_one_line(bench, argv, message):
    with pytest.raises(GradtapeError) as e:
        bench["parse_args"](argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def _args(bench, tmp_path, *more):
    return bench["parse_args"](["--out", str(tmp_path), "--steps", "4", "--seeds", "2",
                                *more])


def test_runs_are_reused_resumed_or_started_over(bench, tmp_path):
    args = _args(bench, tmp_path, "--data", "records")
    runs = bench["plan_runs"](args)
    assert len(runs) == 2 * 3 and runs[0].folder == tmp_path / "records" / "float32-seed0"
    run, cfg = runs[0], bench["config"](args, runs[0])
    assert bench["state"](run, cfg) == "new"
    run.folder.mkdir(parents=True)
    (run.folder / "gradtape-run.json").write_text(json.dumps(
        {"config": dataclasses.asdict(cfg)}))
    assert bench["state"](run, cfg) == "new"  # no checkpoint yet
    (run.folder / "checkpoint").mkdir()
    (run.folder / "checkpoint" / "state.safetensors").write_bytes(b"")
    assert bench["state"](run, cfg) == "partial"
    # other options: a run made with them is not continued
    longer = bench["config"](_args(bench, tmp_path, "--data", "records", "--steps", "5"),
                             run)
    assert bench["state"](run, longer) == "new"
    (run.folder / "outcome.json").write_text(json.dumps({"config": dataclasses.asdict(cfg)}))
    assert bench["state"](run, cfg) == "finished"
    assert bench["state"](run, longer) == "new"
    # how often checkpoints are written does not change what a run computes
    assert bench["state"](run, dataclasses.replace(cfg, save_every=7)) == "finished"


def test_seconds_per_step_counts_from_the_last_start(bench):
    recs = [{"elapsed_s": 1.0}, {"elapsed_s": 2.0}, {"elapsed_s": 0.5}, {"elapsed_s": 1.5},
            {"elapsed_s": 3.0}]
    assert bench["_seconds_per_step"](recs) == 3.0 / 3
    assert bench["_seconds_per_step"]([]) is None


def _fake_outcomes(bench, args, finals):
    """outcome.json for each run: ``finals[compute]`` its seeds' float32-scored losses."""
    for run in bench["plan_runs"](args):
        run.folder.mkdir(parents=True, exist_ok=True)
        loss = finals[run.compute][run.seed]
        (run.folder / "outcome.json").write_text(json.dumps({
            "config": {}, "compute_ran": run.compute, "plan": f"compute: {run.compute}",
            "curve": [[2, loss + 0.5], [4, loss + 0.01]], "s_per_step": 0.5,
            "final_f32": loss}))


def test_verdict_against_float32s_seeds(bench, tmp_path):
    args = _args(bench, tmp_path, "--data", "instructions")
    _fake_outcomes(bench, args, {"float32": [0.40, 0.45], "bf16": [0.41, 0.43],
                                 "int8": [0.46, 0.48]})
    rows = {r["compute"]: r for r in bench["summarise"](args, bench["plan_runs"](args))}
    assert rows["float32"]["final_f32"] == pytest.approx({"mean": 0.425, "min": 0.40,
                                                          "max": 0.45})
    assert rows["float32"]["final"]["mean"] == pytest.approx(0.435)  # the runs' own
    assert rows["bf16"]["vs_float32"]["miss"] == 0.0
    assert rows["int8"]["vs_float32"]["miss"] == pytest.approx(0.47 - 0.45)
    assert bench["verdict"](rows["bf16"]).startswith("within float32's range [0.4000, 0.4500]")
    said = bench["verdict"](rows["int8"])
    assert said == ("above float32's range [0.4000, 0.4500] by 0.02 (4.71% of its "
                    "middle, 0.4x its width)"), said
    rows["int8"]["vs_float32"]["miss"] = -0.01
    assert bench["verdict"](rows["int8"]).endswith("by 0.01 (2.35% of its middle, 0.2x its "
                                                    "width): a lower loss")
    text = bench["table"](args, list(rows.values()))
    assert "| instructions | int8 | int8 | 0.4800 (0.4700 - 0.4900) | 0.4700 (0.4600 - " \
           "0.4800) |" in text, text
    bench["plot"](args, list(rows.values()), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_isa_class(bench):
    assert bench["isa_class"]({"avx2", "avx512f", "amx_bf16"}) == "AMX"
    assert bench["isa_class"]({"avx2", "avx512f", "avx512_bf16"}) == "AVX-512 BF16"
    assert bench["isa_class"]({"avx2", "avx512f"}) == "AVX-512"
    assert bench["isa_class"]({"avx2", "fma"}) == "AVX2"
    assert bench["isa_class"](set()) == "baseline"


@pytest.mark.slow
def test_a_tiny_benchmark_runs_and_is_reused(bench, tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--steps", "2", "--seeds", "1", "--computes", "float32",
            "--data", "instructions", "--eval-every", "1", "--seq-len", "64"]
    assert bench["main"](argv) == 0
    out = capsys.readouterr().out
    assert "ISA class" in out and "estimated time" in out
    o = json.loads((tmp_path / "instructions" / "float32-seed0" / "outcome.json").read_text())
    assert [s for s, _ in o["curve"]] == [1, 2] and o["compute_ran"] == "float32"
    # the float32 step that scores the adapters is the run's own: the same loss
    assert o["final_f32"] == pytest.approx(o["curve"][-1][1], rel=1e-5)
    assert (tmp_path / "heldout_loss.png").is_file()
    assert "| instructions | float32 | float32 |" in (tmp_path / "results.md").read_text()
    assert bench["main"](argv) == 0
    assert "finished earlier, reused" in capsys.readouterr().out
