"""The finetune CLI end to end on a tiny Hugging Face folder: SIGKILL and resume,
user mistakes reported as one line with a non-zero exit code."""

import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gradtape.models.lora import load_adapter


def _cmd(tiny_dir, out, *extra):
    return [sys.executable, "-m", "gradtape.cli", "finetune", "--model", str(tiny_dir / "model"),
            "--data", str(tiny_dir / "text.txt"), "--out", str(out), "--steps", "14",
            "--seq-len", "24", "--batch-size", "2", "--rank", "4", "--lr", "5e-3",
            "--save-every", "2", "--eval-every", "5", "--dtype", "float64", *extra]


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def _steps_logged(out):
    try:
        return len((out / "log.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_sigkill_then_resume_gives_the_same_adapter(tiny_dir, tmp_path, backend):
    ref = _run(_cmd(tiny_dir, tmp_path / "ref", "--backend", backend))
    assert ref.returncode == 0, ref.stderr
    for attempt, kill_after in enumerate(random.Random(7).sample(range(2, 12), 2)):
        out = tmp_path / f"killed{attempt}"
        proc = subprocess.Popen(_cmd(tiny_dir, out, "--backend", backend),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while _steps_logged(out) < kill_after and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        res = _run(_cmd(tiny_dir, out, "--resume", "--backend", backend))
        assert res.returncode == 0, res.stderr
        a, b = load_adapter(tmp_path / "ref" / "adapter"), load_adapter(out / "adapter")
        for key in a.weights:  # bitwise, float64
            assert np.array_equal(a.weights[key][0], b.weights[key][0]), key
            assert np.array_equal(a.weights[key][1], b.weights[key][1]), key
        log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log] == list(range(1, 15))


@pytest.mark.parametrize("setup, args, message", [
    (None, ["--data", "missing.txt"], "does not exist"),
    ("empty", ["--data", "{d}/empty.txt"], "is empty"),
    ("badjson", ["--data", "{d}/bad.jsonl"], "bad.jsonl:2: malformed JSON"),
    (None, ["--targets", "q,zz"], "unknown LoRA target 'zz'"),
    (None, ["--backend", "gpu9000"],
     "--backend must be one of numpy, cpu, cuda, cuda-bf16, got 'gpu9000'"),
    (None, ["--seq-len", "100000"], "longer than the model's context"),
    ("foreign", ["--out", "{d}/foreign"], "not a gradtape run folder"),
    ("unknown", ["--data", "{d}/u.jsonl"], "u.jsonl:1: unknown schema: the keys are 'q', 'a'"),
    (None, ["--columns", "prompt"], "--columns: 'prompt' is not FIELD=COLUMN"),
])
def test_user_mistakes_are_one_clear_line(tiny_dir, tmp_path, setup, args, message):
    d = tmp_path
    (d / "empty.txt").write_text("")
    (d / "bad.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a",\n')
    (d / "foreign").mkdir()
    (d / "foreign" / "notes.txt").write_text("mine")
    (d / "u.jsonl").write_text('{"q": "a", "a": "b"}\n')
    cmd = _cmd(tiny_dir, d / "out")
    for i in range(0, len(args), 2):
        j = cmd.index(args[i]) if args[i] in cmd else None
        value = args[i + 1].format(d=d)
        if j is None:
            cmd += [args[i], value]
        else:
            cmd[j + 1] = value
    res = _run(cmd)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("packing", [[], ["--no-packing"]])
def test_a_hub_dataset_folder_trains(tiny_dir, tmp_path, packing):
    """A folder as the Hub downloads it (Parquet shards of a train and a validation split),
    with other column names: the schema is stated first, the validation split scored;
    examples packed several to a row unless --no-packing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    rows = [{"question": f"what is {i} + {i}?", "answer": str(2 * i)} for i in range(24)]
    pq.write_table(pa.Table.from_pylist(rows[:20]), hub / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[20:]), hub / "validation-00000-of-00001.parquet")
    cmd = _cmd(tiny_dir, tmp_path / "out", "--columns", "prompt=question,completion=answer",
               "--eval-data", str(tmp_path / "hub"), "--steps", "3", "--seq-len", "64",
               *packing)
    cmd[cmd.index("--data") + 1] = str(tmp_path / "hub")
    res = _run(cmd)
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[:2]
    assert first == [f"data: {tmp_path / 'hub'} (1 file): 20 records, prompt/completion "
                     "(prompt, completion)",
                     f"eval data: {tmp_path / 'hub'} (1 file): 4 records, prompt/completion "
                     "(prompt, completion)"], res.stdout
    assert "eval loss" in res.stdout
    rows = "into 20 rows" if packing else "into 7 rows"  # 16-20 tokens each, about 3 a row
    assert f"{'padded' if packing else 'packed'} 20 examples {rows} of 64 tokens" in res.stdout, res.stdout
