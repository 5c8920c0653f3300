"""The data people have (``train.records``): every schema in every container (JSON Lines,
a JSON array, Parquet, a dataset folder) read into the same normal form, masked to its
answers and trained on; ``--columns``; and every mistake as one line naming the record."""

from __future__ import annotations

import random

import pytest

from gradtape.errors import GradtapeError
from gradtape.train import data as data_mod
from gradtape.train.finetune import FinetuneConfig, finetune
from gradtape.train.records import parse_columns

from support.filebuilders import write_records as write
from support.tinymodel import tiny_model

ANSWER = "yes"


def _prompt(rng):
    return "".join(rng.choice("abcdefghij") for _ in range(rng.randint(5, 20)))


# schema -> a record with this prompt and answer
RECORDS = {
    "OpenAI chat": lambda p, a: {"messages": [{"role": "user", "content": p},
                                              {"role": "assistant", "content": a}]},
    "ShareGPT": lambda p, a: {"conversations": [{"from": "human", "value": p},
                                                {"from": "gpt", "value": a}]},
    "Alpaca": lambda p, a: {"instruction": p[:3], "input": p[3:], "output": a},
    "prompt/completion": lambda p, a: {"prompt": p, "completion": a},
}


def _rows(schema, n=64, seed=0):
    rng = random.Random(seed)
    return [RECORDS[schema](_prompt(rng), ANSWER) for _ in range(n)]


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.parquet",
                                  "hub/data/train-00000-of-00001.parquet"])
@pytest.mark.parametrize("schema", list(RECORDS))
def test_every_schema_in_every_file_reads_the_same(tmp_path, schema, name):
    rows = _rows(schema, n=5)
    path = write(tmp_path / name, rows)
    given = tmp_path / "hub" if name.startswith("hub") else path
    d = data_mod.read_data(given)
    assert d.schema.name == schema and len(d.records) == 5
    assert schema in d.describe() and "5 records" in d.describe()
    ref = data_mod.read_data(write(tmp_path / "ref" / "r.jsonl", _rows(schema, n=5)))
    assert [r for _, r in d.records] == [r for _, r in ref.records]


def test_alpaca_and_sharegpt_become_the_same_chat(tmp_path):
    alpaca = {"instruction": "Sum these.", "input": "2 3", "output": "5", "system": "Be brief."}
    share = {"conversations": [{"from": "system", "value": "Be brief."},
                               {"from": "human", "value": "Sum these.\n\n2 3"},
                               {"from": "gpt", "value": "5"}]}
    a = data_mod.read_data(write(tmp_path / "a.jsonl", [alpaca])).records[0][1]
    s = data_mod.read_data(write(tmp_path / "s.jsonl", [share])).records[0][1]
    assert a == s == {"messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Sum these.\n\n2 3"},
                                   {"role": "assistant", "content": "5"}]}
    # no input, no system: the instruction alone is the user's turn
    bare = data_mod.read_data(write(tmp_path / "b.parquet", [
        {"instruction": "Hi", "input": None, "output": "Hello", "system": None}]))
    assert bare.records[0][1]["messages"] == [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello"}]


def test_only_the_answer_is_a_target(tmp_path):
    m = tiny_model()
    d = data_mod.read_data(write(tmp_path / "a.jsonl", [
        {"instruction": "question?", "output": "answer"}]))
    seqs = data_mod.tokenize_data(d, m.tokenizer, 64, pad_id=256)
    counted = seqs.targets[0][seqs.targets[0] != data_mod.IGNORE]
    assert counted.tolist() == m.tokenizer.encode("answer</assistant>\n")
    every = data_mod.tokenize_data(d, m.tokenizer, 64, pad_id=256, train_on_prompt=True)
    n = len(m.tokenizer.encode("<user>question?</user>\n<assistant>answer</assistant>\n"))
    assert (every.targets[0] != data_mod.IGNORE).sum() == n - 1  # all but the first token


def test_text_records_continue_into_further_rows(tmp_path):
    m = tiny_model()
    d = data_mod.read_data(write(tmp_path / "t.parquet", [{"text": "x" * 30}, {"text": "ab"}]))
    examples, skipped = data_mod.tokenize_examples(d, m.tokenizer, 16)
    # 30 bytes + eos = 31 tokens: rows of 16 and 15; "ab" + eos: 3 tokens
    assert [len(i) for i, _ in examples] == [16, 15, 3] and skipped == 0
    assert all(mask.all() for _, mask in examples)
    # 16 + 1 tokens: a last lone token is no example; an empty text (eos alone) is one, skipped
    d = data_mod.read_data(write(tmp_path / "e.jsonl", [{"text": "y" * 16}, {"text": ""}]))
    examples, skipped = data_mod.tokenize_examples(d, m.tokenizer, 16)
    assert [len(i) for i, _ in examples] == [16] and skipped == 1


def test_columns_map_other_names(tmp_path):
    rows = [{"question": "q%d" % i, "answer": "a", "id": i} for i in range(3)]
    for name in ("q.jsonl", "q.parquet"):
        path = write(tmp_path / name, rows)
        d = data_mod.read_data(path, columns="prompt=question,completion=answer")
        assert d.schema.name == "prompt/completion"
        assert d.records[1][1] == {"prompt": "q1", "completion": "a"}
    assert parse_columns(" prompt = question ") == {"question": "prompt"}
    with pytest.raises(GradtapeError, match=r"--columns: unknown field 'answer'; fields are "
                                            r"messages, conversations, system, instruction"):
        parse_columns("answer=x")
    with pytest.raises(GradtapeError, match=r"--columns: 'prompt' is not FIELD=COLUMN"):
        parse_columns("prompt")


@pytest.mark.parametrize("name, rows, columns, message", [
    ("u.jsonl", [{"question": "a", "reply": "b"}], "",
     r"u.jsonl:1: unknown schema: the keys are 'question', 'reply'; accepted: messages "
     r"\(OpenAI chat\); conversations \(ShareGPT\); instruction\+output \(Alpaca\); "
     r"prompt\+completion \(prompt/completion\); text \(text\) \(other names map with "
     r"--columns, e.g. --columns prompt=question,completion=answer\)$"),
    ("u.parquet", [{"question": "a", "reply": "b"}], "",
     r"u.parquet: unknown schema: the columns are 'question', 'reply'; accepted: "),
    ("u.parquet", [{"question": "a", "reply": "b"}], "prompt=question,completion=answr",
     r"u.parquet: unknown schema: the columns are 'question', 'reply'; --columns maps "
     r"'answr', which is not among them; accepted"),
    ("m.jsonl", [{"prompt": "a", "completion": "b"}, {"instruction": "a", "output": "b"}], "",
     r"m.jsonl:2: expected the prompt/completion fields prompt, completion like the first "
     r"record; 'prompt' is missing \(keys: 'instruction', 'output'\)$"),
    ("m.json", [{"instruction": "a", "output": "b"}, {"instruction": "a", "output": 3}], "",
     r"m.json: record 2: 'output' must be a string, got int$"),
    ("m.parquet", [{"instruction": "a", "output": "b"}, {"instruction": "a", "output": None}],
     "", r"m.parquet: row 2: 'output' must be a string, got null$"),
    ("s.jsonl", [{"conversations": [{"from": "human", "value": "a"},
                                    {"from": "robot", "value": "b"}]}], "",
     r"s.jsonl:1: unknown speaker 'robot' in 'conversations' \(accepted: human, user, gpt, "),
    ("s.jsonl", [{"conversations": [{"from": "human", "value": "a"}]}], "",
     r"s.jsonl:1: no assistant message to learn from$"),
])
def test_a_bad_record_is_one_line(tmp_path, name, rows, columns, message):
    with pytest.raises(GradtapeError, match=message):
        data_mod.read_data(write(tmp_path / name, rows), columns=columns)


def test_dataset_folder_splits(tmp_path):
    hub = tmp_path / "hub"
    write(hub / "data" / "train-00000-of-00002.parquet", _rows("Alpaca", 3, seed=1))
    write(hub / "data" / "train-00001-of-00002.parquet", _rows("Alpaca", 2, seed=2))
    write(hub / "data" / "test-00000-of-00001.parquet", _rows("Alpaca", 4, seed=3))
    (hub / "README.md").write_text("# a dataset card\n")
    train = data_mod.read_data(hub)
    assert len(train.records) == 5 and [f.name for f in train.files] == [
        "train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert "(2 files)" in train.describe()
    assert len(data_mod.read_data(hub, split="eval").records) == 4  # no validation: test
    write(hub / "data" / "validation-00000-of-00001.parquet", _rows("Alpaca", 6, seed=4))
    assert len(data_mod.read_data(hub, split="eval").records) == 6
    # another schema in another file of the split is a mistake
    write(hub / "data" / "train-00002-of-00002.parquet", _rows("ShareGPT", 1))
    with pytest.raises(GradtapeError, match=r"train-00002-of-00002.parquet: expected the "
                                            r"Alpaca columns instruction, output like the first "
                                            r"file; the columns are 'conversations'$"):
        data_mod.read_data(hub)
    only_test = tmp_path / "t"
    write(only_test / "test.jsonl", _rows("Alpaca", 2))
    with pytest.raises(GradtapeError, match=r"^--data .*/t: has no train split \(splits found: test\)$"):
        data_mod.read_data(only_test, "--data")


def test_not_parquet_is_one_line(tmp_path):
    p = tmp_path / "x.parquet"
    p.write_bytes(b"PAR1 but not really")
    with pytest.raises(GradtapeError, match=r"x.parquet: not a readable Parquet file"):
        data_mod.read_data(p, "--data")


def _train(tmp_path, data, name, **kw):
    base = dict(data=str(data), out=str(tmp_path / name), steps=100, seq_len=64, batch_size=4,
                rank=8, lr=1e-2, warmup=2, eval_every=0, save_every=1000, dtype="float64",
                backend="numpy", progress=False)
    lines = []
    return finetune(FinetuneConfig(**{**base, **kw}), model=tiny_model(head_scale=16),
                    log=lines.append), lines


@pytest.mark.parametrize("schema", [s if i == 0 else pytest.param(s, marks=pytest.mark.slow)
                                    for i, s in enumerate(RECORDS)])  # 100 steps each
def test_random_prompts_and_a_constant_answer_train_to_a_loss_near_zero(tmp_path, schema):
    """Only the answer is learnable: masked right, the loss goes to ~0; trained on the
    random prompts too, it cannot."""
    data = write(tmp_path / "d.parquet", _rows(schema))
    summary, lines = _train(tmp_path, data, "masked")
    assert lines[0].startswith(f"data: {data}: 64 records, {schema} (")
    assert summary["final_loss"] < 0.01 and summary["eval_loss"] < 0.05
    every, _ = _train(tmp_path, data, "every", train_on_prompt=True)
    assert every["final_loss"] > 0.5


def test_eval_data_and_skipped_examples(tmp_path):
    rows = _rows("prompt/completion", 20) + [{"prompt": "x", "completion": ""}]
    data = write(tmp_path / "d.jsonl", rows)
    held = write(tmp_path / "v.json", _rows("prompt/completion", 5, seed=9))
    summary, lines = _train(tmp_path, data, "run", steps=3, eval_data=str(held))
    assert lines[1] == f"eval data: {held}: 5 records, prompt/completion (prompt, completion)"
    # "" + eos: the end token is a target after the prompt, so nothing is skipped ...
    assert not any(line.startswith("warning") for line in lines)
    # ... but a prompt that fills the row leaves no target
    long = write(tmp_path / "l.jsonl", rows + [{"prompt": "p" * 80, "completion": "c"}] * 2)
    _, lines = _train(tmp_path, long, "long", steps=1)
    warn = [line for line in lines if line.startswith("warning")]
    assert warn == ["warning: --data: 2 of 23 examples have no target token within --seq-len "
                    "64 (an empty answer, or a prompt that fills the row); skipped"]
