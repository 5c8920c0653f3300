"""``gradtape generate``: options, streaming output, adapters, errors."""

from __future__ import annotations

import io

import pytest

from gradtape import models
from gradtape.cli import main
from gradtape.cli.generate import StreamPrinter


@pytest.fixture
def use_session_model(monkeypatch, smollm2):
    """``gradtape generate --model smollm2`` gets the session's already-loaded model."""
    real = models.load
    monkeypatch.setattr(models, "load",
                        lambda name="smollm2", **kw: smollm2 if name == "smollm2"
                        else real(name, **kw))
    return smollm2


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--model", "--prompt", "--chat", "--adapter", "--max-new-tokens",
                "--temperature", "--top-p", "--seed", "smollm2"):
        assert opt in out


def test_generate_continues_prompt(use_session_model, capsys):
    assert main(["generate", "--prompt", "The capital of France is",
                 "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(" Paris") and out.endswith("\n")


def test_generate_chat_stops_at_eos(use_session_model, capsys):
    assert main(["generate", "--chat", "--prompt", "What is 2+2? Answer with one number.",
                 "--max-new-tokens", "30"]) == 0
    out = capsys.readouterr().out
    assert "4" in out and "<|im_end|>" not in out


def test_generate_with_zero_adapter_equals_base(use_session_model, capsys, tmp_path):
    lora = pytest.importorskip("gradtape.models.lora")
    ad = lora.init_adapter(use_session_model.config, rank=2, targets=("q", "v"),
                           base_model=use_session_model.name)
    ad.save(tmp_path / "ad")  # B = 0: the adapted model equals the base
    args = ["generate", "--prompt", "Once upon a time", "--max-new-tokens", "5"]
    assert main(args) == 0
    base = capsys.readouterr().out
    assert main(args + ["--adapter", str(tmp_path / "ad")]) == 0
    assert capsys.readouterr().out == base


def test_sampling_is_seeded(use_session_model, capsys):
    args = ["generate", "--prompt", "My favourite animal is", "--max-new-tokens", "6",
            "--temperature", "1.2", "--top-p", "0.9", "--seed", "5"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize("args, msg", [
    (["--model", "/nonexistent/model.gguf"], "no such file"),
    (["--top-p", "0"], "--top-p"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
])
def test_errors_are_one_line(capsys, args, msg):
    assert main(["generate", "--prompt", "hi", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gradtape generate: error:") and msg in err
    assert "Traceback" not in err


def test_stream_printer_holds_back_partial_characters(smollm2):
    tok = smollm2.tokenizer
    text = "Hi 😀 and 中文 ok"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # the emoji / CJK span several byte tokens
    out = io.StringIO()
    p = StreamPrinter(tok, out, skip={2})
    writes = []
    for t in ids + [2]:
        before = out.getvalue()
        p(t)
        writes.append(out.getvalue()[len(before):])
    p.finish()
    assert out.getvalue() == text + "\n"
    assert all("\ufffd" not in w for w in writes)
