"""Preference data (``train.records`` with ``task="preference"``, ``train.pairs``): TRL's
three forms in every container (JSON Lines, a JSON array, Parquet, a dataset folder),
``--columns``, the rows a step takes (prompt masked and the same in both rows, chosen rows
then rejected), ``seq_len``, every mistake as one line naming the record, and the token
rows equal to TRL's ``DPOTrainer`` with the real SmolLM2 tokenizer."""

from __future__ import annotations


import numpy as np
import pytest

from gradtape.errors import GradtapeError
from gradtape.train.data import IGNORE, read_data
from gradtape.train.pairs import load_pairs, pair_rows, tokenize_pairs

from support.filebuilders import write_records as write
from support.tinymodel import ByteTokenizer

TOK = ByteTokenizer()
EOS = ByteTokenizer.eos_id


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def _standard(q, good, bad):
    return {"prompt": f"Q: {q} A:", "chosen": f" {good}", "rejected": f" {bad}"}


def _chat(q, good, bad):
    return {"prompt": [user(q)], "chosen": [bot(good)], "rejected": [bot(bad)]}


def _implicit_text(q, good, bad):  # Anthropic HH
    return {"chosen": f"\n\nHuman: {q}\n\nAssistant: {good}",
            "rejected": f"\n\nHuman: {q}\n\nAssistant: {bad}"}


def _implicit_chat(q, good, bad):  # UltraFeedback-binarized: a prompt string beside
    return {"prompt": q, "chosen": [user(q), bot(good)], "rejected": [user(q), bot(bad)],
            "score_chosen": 8.0, "score_rejected": 2.5}


# schema -> (record maker, the normal form of its record for (q, good, bad))
FORMS = {
    "TRL preference": (_standard, lambda q, g, b: _standard(q, g, b)),
    "TRL preference, conversational": (_chat, lambda q, g, b: _chat(q, g, b)),
    "implicit prompt": (_implicit_text, lambda q, g, b: {
        "prompt": f"\n\nHuman: {q}\n\nAssistant:", "chosen": f" {g}", "rejected": f" {b}"}),
    "implicit prompt, conversational": (_implicit_chat, lambda q, g, b: _chat(q, g, b)),
}
TRIPLES = [("sky?", "blue", "green"), ("two and two?", "four", "three"),
           ("capital of France?", "Paris", "Lyon")]


def _read(path, **kw):
    return read_data(path, task="preference", **kw)


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.parquet",
                                  "hub/data/train-00000-of-00001.parquet"])
@pytest.mark.parametrize("schema", list(FORMS))
def test_every_form_in_every_file(tmp_path, schema, name):
    make, normal = FORMS[schema]
    path = write(tmp_path / name, [make(*t) for t in TRIPLES])
    d = _read(tmp_path / "hub" if name.startswith("hub") else path)
    assert d.schema.name == schema and d.schema.task == "preference"
    assert f"3 records, {schema} (" in d.describe()
    assert [r for _, r in d.records] == [normal(*t) for t in TRIPLES]
    rows, skipped = load_pairs(path, TOK, 96)
    assert len(rows) == 3 and skipped == 0


def test_columns_rename_pair_fields(tmp_path):
    rows = [{"question": f"Q: {q}", "good": f" {g}", "bad": f" {b}"} for q, g, b in TRIPLES]
    for name in ("c.jsonl", "c.parquet"):
        path = write(tmp_path / name, rows)
        d = _read(path, columns="prompt=question,chosen=good,rejected=bad")
        assert d.schema.name == "TRL preference"
        assert d.records[0][1] == {"prompt": "Q: sky?", "chosen": " blue", "rejected": " green"}
    with pytest.raises(GradtapeError, match=r"c.jsonl:1: unknown schema: the keys are "
                       r"'question', 'good', 'bad'; accepted: prompt\+chosen\+rejected "
                       r".*--columns chosen=good,rejected=bad"):
        _read(tmp_path / "c.jsonl")


@pytest.mark.parametrize("schema", list(FORMS))
def test_rows_mask_the_prompt_and_share_it(tmp_path, schema):
    make, _ = FORMS[schema]
    path = write(tmp_path / "p.jsonl", [make(*t) for t in TRIPLES])
    pairs, _ = tokenize_pairs(_read(path), TOK, 128)
    rows = pair_rows(pairs, 128, pad_id=7)
    b = rows.batch([2, 0])
    n = 2
    assert b.ids.shape == (2 * n, 128) and b.n_pairs == n
    for j, i in enumerate([2, 0]):
        p = pairs[i]
        for r, comp in ((j, p.chosen), (n + j, p.rejected)):  # chosen rows first
            full = np.concatenate([p.prompt, comp])
            k, m = len(p.prompt), len(full)
            assert np.array_equal(b.ids[r, :m], full) and (b.ids[r, m:] == 7).all()
            # position t predicts token t+1 where that token is of the completion
            assert (b.targets[r, :k - 1] == IGNORE).all()
            assert np.array_equal(b.targets[r, k - 1:m - 1], comp)
            assert (b.targets[r, m - 1:] == IGNORE).all()
            assert (b.sequence[r, :m] == r).all() and (b.sequence[r, m:] == -1).all()
            assert np.array_equal(b.positions[r], np.arange(128)) and not b.segments[r].any()
            assert b.completion_tokens()[r] == len(comp)
        # the prompt's tokens: the same in both rows, and the completions differ
        k = len(p.prompt)
        assert k > 0 and np.array_equal(b.ids[j, :k], b.ids[n + j, :k])
        assert not np.array_equal(p.chosen, p.rejected)
    assert b.rows()[0] is b.ids and len(b.rows()) == 4


def test_text_completions_end_with_eos_and_chats_with_the_template(tmp_path):
    text = write(tmp_path / "t.jsonl", [_standard(*TRIPLES[0])])
    p = tokenize_pairs(_read(text), TOK, 64)[0][0]
    assert bytes(p.prompt.tolist()) == b"Q: sky? A:"
    assert p.chosen.tolist() == list(b" blue") + [EOS]
    assert p.rejected.tolist() == list(b" green") + [EOS]
    chat = write(tmp_path / "c.jsonl", [_chat(*TRIPLES[0])])
    p = tokenize_pairs(_read(chat), TOK, 64)[0][0]
    assert bytes(p.prompt.tolist()) == b"<user>sky?</user>\n<assistant>"
    assert bytes(p.chosen.tolist()) == b"blue</assistant>\n"


def test_seq_len_cuts_rows_and_skips_pairs_whose_prompt_fills_them(tmp_path):
    rows = [_standard("x" * 40, "yes", "no"), _standard("q", "a long answer", "no")]
    path = write(tmp_path / "l.jsonl", rows)
    pairs, skipped = tokenize_pairs(_read(path), TOK, 20)
    assert skipped == 1 and len(pairs) == 1  # the first prompt alone is 46 tokens
    b = pair_rows(pairs, 20).batch([0])
    assert b.ids.shape == (2, 20)
    k = len(pairs[0].prompt)
    assert np.array_equal(b.ids[0], np.concatenate([pairs[0].prompt, pairs[0].chosen])[:20])
    assert b.completion_tokens()[0] == 20 - k  # cut: the last position predicts nothing
    assert (b.sequence[0] == 0).all()
    with pytest.raises(GradtapeError, match=r"l.jsonl: no pair keeps a completion token "
                       r"within seq_len=5 \(rows are cut to their first seq_len tokens; "
                       r"a pair whose prompt fills them is skipped\)"):
        tokenize_pairs(_read(path), TOK, 5)


SFT = {"messages": [user("hi"), bot("hello")]}
CHAT = _chat("q", "a", "b")
BAD = [
    ("missing rejected", [{"prompt": "q", "chosen": "a"}],
     r"b.jsonl:1: a preference pair needs 'chosen' and 'rejected'; 'rejected' is missing "
     r"\(the keys are 'prompt', 'chosen'\)"),
    ("missing chosen later", [_standard("q", "a", "b"), {"prompt": "q", "rejected": "b"}],
     r"b.jsonl:2: expected the TRL preference fields prompt, chosen, rejected like the first "
     r"record; 'chosen' is missing"),
    ("chosen equals rejected", [_standard("q", "a", "a")],
     r"b.jsonl:1: 'chosen' and 'rejected' are the same: nothing to prefer"),
    ("chats equal", [_chat("q", "a", "a")],
     r"b.jsonl:1: 'chosen' and 'rejected' are the same: nothing to prefer"),
    ("implicit equal", [{"chosen": "same", "rejected": "same"}],
     r"b.jsonl:1: 'chosen' and 'rejected' are the same: nothing to prefer"),
    ("empty completion", [{"prompt": "q", "chosen": "", "rejected": "b"}],
     r"b.jsonl:1: 'chosen' is empty: no completion to score"),
    ("empty chat completion", [_chat("q", "a", "")],
     r"b.jsonl:1: 'rejected' is empty: no completion to score"),
    ("completion not assistant", [{**CHAT, "chosen": [user("a")]}],
     r"b.jsonl:1: 'chosen' must be assistant turns; its message 1 is 'user'"),
    ("implicit completion not assistant",
     [{"chosen": [user("q"), bot("a")], "rejected": [user("q"), user("b")]}],
     r"b.jsonl:1: 'rejected' must be assistant turns; its message 1 is 'user'"),
    ("completion not messages", [{**CHAT, "rejected": "b"}],
     r"b.jsonl:1: 'rejected' must be a non-empty list of \{\"role\": str, \"content\": str\}"),
    ("prompt not a string", [{"prompt": 3, "chosen": "a", "rejected": "b"}],
     r"b.jsonl:1: 'prompt' must be a string, got int"),
    ("standard then conversational", [_standard("q", "a", "b"), CHAT],
     r"b.jsonl:2: a TRL preference, conversational record, but the first record is TRL "
     r"preference: the schema changes mid-file"),
    ("implicit then explicit", [_implicit_text("q", "a", "b"), _standard("q", "a", "b")],
     r"b.jsonl:2: a TRL preference record, but the first record is implicit prompt: the "
     r"schema changes mid-file"),
    ("no shared prefix", [{"chosen": "yes it is", "rejected": "no it is not"}],
     r"b.jsonl:1: 'chosen' and 'rejected' share no prompt \(they differ from the start\); "
     r"give it as 'prompt'"),
    ("nothing after the prefix", [{"chosen": "Q: hi A:", "rejected": "Q: hi A: hello"}],
     r"b.jsonl:1: 'chosen' is the beginning of the other: nothing follows the prompt they "
     r"share in it \(an empty completion\)"),
    ("chat with nothing after", [{"chosen": [user("q")], "rejected": [user("q"), bot("b")]}],
     r"b.jsonl:1: 'chosen' is the beginning of the other"),
    ("chats differ from the start", [{"chosen": [user("q"), bot("a")],
                                      "rejected": [user("p"), bot("a")]}],
     r"b.jsonl:1: 'chosen' and 'rejected' share no prompt"),
    ("SFT data", [SFT],
     r"b.jsonl:1: SFT data \(OpenAI chat: the keys are 'messages'\), where preference pairs "
     r"are wanted; accepted: prompt\+chosen\+rejected \(TRL preference, conversational\); "
     r"prompt\+chosen\+rejected \(TRL preference\); chosen\+rejected \(implicit prompt, "
     r"conversational\); chosen\+rejected \(implicit prompt\)$"),
    ("prompt/completion data", [{"prompt": "q", "completion": "a"}],
     r"b.jsonl:1: SFT data \(prompt/completion: the keys are 'prompt', 'completion'\), "
     r"where preference pairs are wanted; accepted: prompt\+chosen\+rejected"),
]


@pytest.mark.parametrize("rows,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_pairs_are_one_line_naming_the_record(tmp_path, rows, message):
    with pytest.raises(GradtapeError, match=message) as e:
        _read(write(tmp_path / "b.jsonl", rows))
    assert "\n" not in str(e.value)


def test_bad_pairs_name_the_record_in_every_container(tmp_path):
    rows = [_standard("q", "a", "b"), _standard("q", "a", "a")]
    for name, where in (("b.json", r"b.json: record 2"), ("b.parquet", r"b.parquet: row 2")):
        with pytest.raises(GradtapeError, match=f"{where}: 'chosen' and 'rejected' are the same"):
            _read(write(tmp_path / name, rows))
    with pytest.raises(GradtapeError, match=r"b2.parquet: a preference pair needs 'chosen' and "
                       r"'rejected'; 'chosen' is missing \(the columns are 'prompt', 'rejected'\)"):
        _read(write(tmp_path / "b2.parquet", [{"prompt": "q", "rejected": "b"}]))


def test_preference_data_asked_for_sft_names_the_sft_schemas(tmp_path):
    for make in (_standard, _implicit_text):
        path = write(tmp_path / "p.jsonl", [make("q", "a", "b")])
        with pytest.raises(GradtapeError, match=r"p.jsonl:1: preference pairs \(.*\), where "
                           r"SFT data are wanted; accepted: messages \(OpenAI chat\); "):
            read_data(path)
    with pytest.raises(GradtapeError, match=r"p.parquet: preference pairs \(TRL preference, "
                       r"conversational: the columns are 'prompt', 'chosen', 'rejected'\)"):
        read_data(write(tmp_path / "p.parquet", [_standard("q", "a", "b")]))
    # a file that is both (UltraFeedback's messages column) is SFT data where SFT is asked
    both = write(tmp_path / "u.jsonl", [{**_implicit_chat("q", "a", "b"),
                                         "messages": [user("q"), bot("a")]}])
    assert read_data(both).schema.name == "OpenAI chat"
    assert _read(both).schema.name == "implicit prompt, conversational"


def test_plain_text_is_not_pairs(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("just some text\n")
    with pytest.raises(GradtapeError, match=r"t.txt: plain text, where preference pairs are "
                       r"wanted"):
        _read(path)
    with pytest.raises(GradtapeError, match="plain text, not preference pairs"):
        tokenize_pairs(read_data(path), TOK, 16)


# --- the rows TRL's DPOTrainer makes, with the real SmolLM2 tokenizer ------------------------

def _trl_batch(hf_tokenizer, rows, max_length, tmp_path):
    """TRL's own preparation (extract the prompt, add EOS, tokenize, drop what the prompt
    fills) and its collator."""
    from datasets import Dataset
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    cfg = DPOConfig(output_dir=str(tmp_path / "trl"), max_length=max_length, report_to=[],
                    use_cpu=True, bf16=False)
    trainer = object.__new__(DPOTrainer)  # only what _prepare_dataset reads
    trainer._tokenizer = hf_tokenizer
    ds = DPOTrainer._prepare_dataset(trainer, Dataset.from_list(rows), hf_tokenizer, cfg, "t")
    return DataCollatorForPreference(pad_token_id=0, max_length=max_length)(list(ds))


@pytest.mark.parametrize("schema", list(FORMS))
def test_rows_equal_trl_dpo_trainer(tmp_path, schema, smollm2, hf_tokenizer):
    make, _ = FORMS[schema]
    rows = [make(*t) for t in TRIPLES] + [make("word " * 30 + "?", "fine", "bad")]
    if schema == "implicit prompt, conversational":  # TRL extracts only without a prompt
        trl_rows = [{"chosen": r["chosen"], "rejected": r["rejected"]} for r in rows]
    else:
        trl_rows = rows
    max_length = 36
    path = write(tmp_path / "p.jsonl", rows)
    ours, skipped = load_pairs(path, smollm2.tokenizer, max_length)
    theirs = _trl_batch(hf_tokenizer, trl_rows, max_length, tmp_path)
    ids, keep, comp = (theirs[k].numpy() for k in ("input_ids", "attention_mask",
                                                   "completion_mask"))
    b = ours.batch(np.arange(len(ours)))
    assert len(b.ids) == len(ids) and skipped == len(rows) - len(ours)
    w = ids.shape[1]
    assert np.array_equal(np.where(keep == 1, ids, -1), np.where(b.sequence[:, :w] >= 0,
                                                                  b.ids[:, :w], -1))
    assert (b.sequence[:, w:] == -1).all()
    # TRL scores token t+1 from position t where completion_mask[t+1]: our targets
    scored = np.zeros_like(comp, bool)
    scored[:, :-1] = comp[:, 1:] == 1
    assert np.array_equal(b.targets[:, :w] != IGNORE, scored)
    assert np.array_equal(b.targets[:, :w - 1][scored[:, :-1]], ids[:, 1:][scored[:, :-1]])
