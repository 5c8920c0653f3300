"""The demo finds its data in a source checkout (examples/records)."""

from gradtape.cli import demo


def test_demo_data_folder_exists():
    assert (demo.DATA / "train.jsonl").is_file() and (demo.DATA / "test.jsonl").is_file()
