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
                "--temperature", "--top-p", "--seed", "smollm2", "--top-k", "--min-p",
                "--repetition-penalty", "--stop", "--system", "Ctrl-D", "--weights"):
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
    from gradtape.models import lora
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
    (["--top-p", "1.5"], "top_p (--top-p) must be in (0, 1]"),
    (["--top-k", "-2"], "top_k (--top-k) must be >= 0"),
    (["--min-p", "1"], "min_p (--min-p) must be in [0, 1)"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--stop", ""], "--stop"),
    (["--system", "be brief"], "--system needs --chat"),
])
def test_errors_are_one_line(capsys, args, msg):
    assert main(["generate", "--prompt", "hi", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gradtape generate: error:") and msg in err
    assert "Traceback" not in err


@pytest.mark.slow  # loads the model twice, float32 and kept
def test_generation_reads_stored_weights_and_refuses_a_float32_copy_too_big(
        smollm2_gguf, capsys, monkeypatch):
    """--weights auto (the default) loads the file's blocks, which each token's C step
    reads anyway: no float32 copy (an 8B Q4_K_M's 27.5 GiB grew the process past a 24 GB
    machine before); --weights float32 loads the copy where it fits and is one error,
    before anything is loaded, where it does not.  The answer is the same."""
    from gradtape.models.memory import weight_bytes
    from gradtape.train.memory import OVERHEAD

    loads = []
    real = models.load
    monkeypatch.setattr(models, "load",
                        lambda name, **kw: loads.append(kw) or real(name, **kw))
    args = ["generate", "--model", str(smollm2_gguf), "--prompt", "The capital of France is",
            "--max-new-tokens", "6"]
    assert main(args) == 0
    stored = capsys.readouterr().out
    assert loads == [{"keep_quantized": True}]
    assert main(args + ["--weights", "float32"]) == 0
    assert loads[-1] == {"keep_quantized": False} and capsys.readouterr().out == stored
    too_little = weight_bytes(smollm2_gguf) + OVERHEAD - 1
    monkeypatch.setenv("GRADTAPE_MEM_AVAILABLE", str(too_little))
    assert main(args + ["--weights", "float32"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gradtape generate: error: not enough memory: the float32 "
                          "weights of") and "--weights stored" in err
    assert len(loads) == 2  # refused before loading
    assert main(args) == 0 and capsys.readouterr().out == stored


def test_prompt_or_chat_is_required(capsys):
    assert main(["generate"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gradtape generate: error: --prompt is required")


def test_context_error_from_the_api(use_session_model, capsys):
    assert main(["generate", "--prompt", "hi there", "--max-new-tokens", "8191"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gradtape generate: error: the prompt (2 tokens) plus "
                          "max_new_tokens 8191 is longer than the model's context (8192")


def test_stop_string_is_not_printed(use_session_model, capsys):
    args = ["generate", "--prompt", "The capital of France is", "--max-new-tokens", "12"]
    assert main(args) == 0
    full = capsys.readouterr().out
    word = full.split()[1]
    assert main(args + ["--stop", word]) == 0
    out = capsys.readouterr().out
    assert out == full[:full.index(word)] + "\n"


def test_chat_repl_keeps_history(use_session_model, capsys, monkeypatch):
    """Piped lines: one answer per line, each prompt holding the earlier turns."""
    prompts = []
    real = type(use_session_model).generate

    def spy(self, ids, *a, **kw):
        prompts.append(self.tokenizer.decode(ids))
        return real(self, ids, *a, **kw)

    monkeypatch.setattr(type(use_session_model), "generate", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("What is 2+2?\n\nAnd 3+3?\n"))
    assert main(["generate", "--chat", "--max-new-tokens", "12", "--system", "Be brief."]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(prompts) == 2 and len(out) == 2  # the blank line is skipped
    assert "Be brief." in prompts[0] and "What is 2+2?" in prompts[0]
    # the second turn carries the first question and the model's first answer
    assert prompts[1].startswith(prompts[0]) and out[0].strip() in prompts[1]
    assert prompts[1].endswith("And 3+3?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_without_standard_input_is_one_error(use_session_model, capsys, monkeypatch):
    """Started with stdin closed (``<&-``: Python's sys.stdin is None), the chat says so."""
    monkeypatch.setattr("sys.stdin", None)
    assert main(["generate", "--chat", "--max-new-tokens", "2"]) == 1
    assert capsys.readouterr().err == ("gradtape generate: error: no standard input to read "
                                       "the chat from; give --prompt\n")


@pytest.mark.slow  # a subprocess under a pseudo-terminal
def test_chat_repl_under_a_terminal(smollm2_gguf, tmp_path):
    """In a pseudo-terminal: a banner, the '> ' prompt, an answer, and Ctrl-D leaves."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time

    main_fd, sub_fd = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "gradtape.cli", "generate", "--chat",
                             "--max-new-tokens", "6"], stdin=sub_fd, stdout=sub_fd,
                            stderr=sub_fd, close_fds=True)
    os.close(sub_fd)
    seen = b""

    def read_until(marker, timeout=120, start=0):
        nonlocal seen
        end = time.time() + timeout
        while marker not in seen[start:] and time.time() < end:
            if select.select([main_fd], [], [], 0.5)[0]:
                try:
                    seen += os.read(main_fd, 4096)
                except OSError:
                    break
        return marker in seen[start:]

    try:
        assert read_until(b"Ctrl-D leaves"), seen
        assert read_until(b"> "), seen
        n = len(seen)
        os.write(main_fd, b"Say hello.\n")
        assert read_until(b"\n> ", 120, start=n), seen
        assert b"Say hello." in seen[n:]  # echoed by the terminal, then the answer
        os.write(main_fd, b"\x04")  # Ctrl-D at the prompt
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main_fd)


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


def test_stream_printer_never_prints_a_stop_string(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("one two three four")
    out = io.StringIO()
    p = StreamPrinter(tok, out, stop=[" three"])
    for t in ids:
        p(t)
        assert "thr" not in out.getvalue()
    assert p.finish() == "one two" and out.getvalue() == "one two\n"
