"""The preference demo's pairs (examples/preferences): they read as TRL preference data,
each pair differs only by the sign-off the demo teaches, the held-out prompts are not
trained on, and make_data.py remakes the same files; ``demo --help`` offers --method."""

import importlib.util
import json

from gradtape.cli import demo_preference
from gradtape.cli.main import main
from gradtape.train.records import read_data

DATA = demo_preference.DATA


def _rows(name):
    return [json.loads(x) for x in (DATA / name).read_text().splitlines()]


def test_pairs_read_as_trl_preference_data():
    for name, n in (("train.jsonl", 400), ("test.jsonl", 40)):
        data = read_data(DATA / name, "--data", task="preference")
        assert len(data.records) == n
        assert "preference" in data.schema.name.lower()


def test_pairs_differ_by_the_sign_off_only():
    for name in ("train.jsonl", "test.jsonl"):
        for r in _rows(name):
            assert set(r) == {"prompt", "chosen", "rejected"}
            assert r["chosen"] != r["rejected"] and r["rejected"].strip()
            assert r["chosen"] == r["rejected"] + "\n\n" + demo_preference.SIGN_OFF


def test_split_has_no_overlap():
    train = {r["prompt"] for r in _rows("train.jsonl")}
    test = [r["prompt"] for r in _rows("test.jsonl")]
    assert len(test) == len(set(test)) and not train & set(test)


def test_make_data_remakes_the_same_files(tmp_path):
    spec = importlib.util.spec_from_file_location("make_pairs", DATA / "make_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(tmp_path)
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes()


def test_demo_help_offers_the_methods(capsys):
    try:
        main(["demo", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "--method" in out and "dpo" in out and "simpo" in out
