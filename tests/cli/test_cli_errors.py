"""Every command line mistake is one line, ``gradtape COMMAND: error: ...``, found before
a model is loaded: option ranges (declared once, the same check for ``FinetuneConfig``),
input paths (missing, folders, binary or non-UTF-8 data with the byte offset), output
paths (not creatable, not writable, special files); and the top-level guard around any
other exception (one line, the traceback with ``--debug`` or ``GRADTAPE_DEBUG=1``).

Commands run in-process through ``gradtape.cli.main``; one subprocess checks the guard
as a user sees it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradtape import checks
from gradtape.cli import main
from gradtape.errors import GradtapeError
from gradtape.models.lora import init_adapter
from gradtape.train.finetune import FinetuneConfig, flag

from support.tinymodel import tiny_model, write_hf_folder

TEXT = "pack my box with five dozen liquor jugs. " * 20
HAVE_PROC = Path("/proc/self").is_dir()


class ModelLoaded(BaseException):
    """Raised by a stand-in ``models.load``: the command got past its checks.  Not an
    ``Exception``, so the CLI's guard lets it through."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_errors")
    write_hf_folder(tiny_model(seed=4), root / "model")
    init_adapter(tiny_model(seed=4).config, rank=2, targets="q,v").save(root / "adapter")
    (root / "text.txt").write_text(TEXT)
    (root / "some.bin").write_bytes(b"hello\n\xff\xfe\x00binary")
    (root / "nul.txt").write_bytes(b"text, then\x00a NUL")
    return root


@pytest.fixture
def no_model(monkeypatch):
    """A command that reaches ``models.load`` raises ``ModelLoaded``."""
    def load(*a, **k):
        raise ModelLoaded
    monkeypatch.setattr("gradtape.models.load", load)


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of ``gradtape ARGV`` in this process."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse: --help, or a value of the wrong type
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(capsys, *argv, rc=1):
    """The one ``error:`` line of a failing command (and no traceback)."""
    code, _, err = run_cli(capsys, *argv)
    assert code == rc, err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, err
    return lines[0]


def finetune_args(files, out, *extra):
    return ["finetune", "--model", files / "model", "--data", files / "text.txt", "--out",
            out, "--steps", "1", "--seq-len", "16", "--batch-size", "2", *extra]


# --- the table, row by row: the exact message, before the model loads ------------
@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "0"], "--seq-len must be >= 2, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--grad-accum", "0"], "--grad-accum must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--eval-frac", "1.5"], "--eval-frac must be in [0, 1), got 1.5"),
    (["--alpha", "0"], "--alpha must be > 0, got 0.0"),
    (["--rank", "0"], "--rank must be >= 1, got 0"),
    (["--seed", "-3"], "--seed must be >= 0, got -3"),
    (["--epochs", "inf"], "--epochs must be a finite number > 0, got inf"),
    (["--save-every", "0"], "--save-every must be >= 1, got 0"),
    (["--dtype", "float16"], "--dtype must be one of float32, float64, got 'float16'"),
    (["--targets", "q,zz"], "--targets: unknown LoRA target 'zz'; choose from q, k, v, o, "
                            "gate, up, down (or all)"),
])
def test_finetune_out_of_range(files, tmp_path, capsys, no_model, extra, message):
    line = one_error(capsys, *finetune_args(files, tmp_path / "out", *extra))
    assert line == f"gradtape finetune: error: {message}"
    assert not (tmp_path / "out").exists()  # nothing was touched either


def test_finetune_binary_data(files, tmp_path, capsys, no_model):
    line = one_error(capsys, *finetune_args(files, tmp_path / "out", "--data",
                                            files / "some.bin"))
    assert line == (f"gradtape finetune: error: --data {files / 'some.bin'}: not UTF-8 text "
                    "(byte 0xff at byte offset 6, line 2); data must be UTF-8 text, JSON Lines, "
                    "a JSON array or Parquet")
    line = one_error(capsys, *finetune_args(files, tmp_path / "out", "--data",
                                            files / "nul.txt"))
    assert line == (f"gradtape finetune: error: --data {files / 'nul.txt'}: not text (a NUL "
                    "byte at byte offset 10, line 1); data must be UTF-8 text, JSON Lines, a JSON "
                    "array or Parquet")


def test_finetune_data_is_a_folder(files, tmp_path, capsys, no_model):
    line = one_error(capsys, *finetune_args(files, tmp_path / "out", "--data", files))
    assert line == (f"gradtape finetune: error: --data {files}: a folder with no data files "
                    "(*.parquet, *.jsonl, or split-named *.json, in it or in its data/)")
    line = one_error(capsys, *finetune_args(files, tmp_path / "out", "--data",
                                            tmp_path / "nope.txt"))
    assert line == f"gradtape finetune: error: --data {tmp_path / 'nope.txt'}: does not exist"


@pytest.mark.skipif(not HAVE_PROC, reason="needs /proc (Linux)")
def test_outputs_that_cannot_be_created(files, capsys, no_model):
    # /proc refuses new files even to root (chmod does not stop root)
    line = one_error(capsys, *finetune_args(files, "/proc/x"))
    assert line.startswith("gradtape finetune: error: --out /proc/x: cannot be created in "
                           "/proc ("), line
    line = one_error(capsys, "merge", "--model", files / "model", "--adapter",
                     files / "adapter", "--out", "/proc/m")
    assert line.startswith("gradtape merge: error: --out /proc/m: cannot be created in "
                           "/proc ("), line
    line = one_error(capsys, "merge", "--model", files / "model", "--adapter",
                     files / "adapter", "--out", "/proc/m.gguf")
    assert line.startswith("gradtape merge: error: --out /proc/m.gguf: cannot write in "
                           "/proc ("), line
    line = one_error(capsys, "export-gguf-lora", "--model", files / "model", "--adapter",
                     files / "adapter", "--out", "/proc/x.gguf")
    assert line.startswith("gradtape export-gguf-lora: error: --out /proc/x.gguf: cannot "
                           "write in /proc ("), line


def test_outputs_that_are_special_files_are_never_replaced(files, capsys, no_model):
    for cmd in ("merge", "export-gguf-lora"):
        line = one_error(capsys, cmd, "--model", files / "model", "--adapter",
                         files / "adapter", "--out", "/dev/null",
                         *(["--format", "gguf"] if cmd == "merge" else []))
        assert "--out /dev/null: exists and is not" in line, line
    assert Path("/dev/null").is_char_device()


def test_outputs_under_a_file(files, tmp_path, capsys, no_model):
    (tmp_path / "f").write_text("a file")
    line = one_error(capsys, *finetune_args(files, tmp_path / "f" / "run"))
    assert line == (f"gradtape finetune: error: --out {tmp_path / 'f' / 'run'}: cannot be "
                    f"created: {tmp_path / 'f'} is not a folder")
    line = one_error(capsys, *finetune_args(files, tmp_path / "f"))
    assert line == f"gradtape finetune: error: --out {tmp_path / 'f'}: exists and is not a folder"
    line = one_error(capsys, "export-gguf-lora", "--model", files / "model", "--adapter",
                     files / "adapter", "--out", tmp_path / "none" / "x.gguf")
    assert line == (f"gradtape export-gguf-lora: error: --out {tmp_path / 'none' / 'x.gguf'}: "
                    f"folder {tmp_path / 'none'} does not exist")
    line = one_error(capsys, "export-gguf-lora", "--model", files / "model", "--adapter",
                     files / "adapter", "--out", tmp_path)
    assert line == (f"gradtape export-gguf-lora: error: --out {tmp_path}: is a folder; give "
                    "a file name")


def test_an_empty_path_is_not_the_current_folder(files, tmp_path, capsys, no_model,
                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error(capsys, "merge", "--model", files / "model", "--adapter",
                     files / "adapter", "--out", "")
    assert line == "gradtape merge: error: --out: the path is empty"
    line = one_error(capsys, *finetune_args(files, tmp_path / "o", "--data", ""))
    assert line == "gradtape finetune: error: --data is required"
    assert list(tmp_path.iterdir()) == []


def test_a_new_output_folder_is_checked_not_created(files, tmp_path, capsys, monkeypatch):
    """The probe leaves nothing behind: a failing command creates no folder."""
    out = tmp_path / "a" / "b" / "merged"
    line = one_error(capsys, "merge", "--model", files / "model", "--adapter",
                     tmp_path / "missing-adapter", "--out", out)
    assert line == (f"gradtape merge: error: --adapter {tmp_path / 'missing-adapter'}: does "
                    "not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["generate", "merge", "export-gguf-lora"])
def test_adapter_paths(files, tmp_path, capsys, no_model, command):
    args = {"generate": ["--prompt", "hi"], "merge": ["--out", tmp_path / "m"],
            "export-gguf-lora": ["--out", tmp_path / "x.gguf"]}[command]
    base = [command, "--model", files / "model", *args, "--adapter"]
    line = one_error(capsys, *base, files / "text.txt")
    assert line == f"gradtape {command}: error: --adapter {files / 'text.txt'}: is not a folder"
    line = one_error(capsys, *base, files)
    assert line == (f"gradtape {command}: error: --adapter {files}: not a LoRA adapter folder "
                    "(adapter_config.json is missing)")


@pytest.mark.parametrize("args, flag_name", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--seed", "-1"], "--seed"),
])
def test_generate_ranges(files, capsys, no_model, args, flag_name):
    # the sampling options are checked by the model's sampling code, which words them
    line = one_error(capsys, "generate", "--model", files / "model", "--prompt", "hi", *args)
    assert line.startswith("gradtape generate: error: ") and flag_name in line, line
    assert line.endswith((f"got {args[1]}", f"got {float(args[1])}")), line


def test_generate_prompt_that_is_not_utf8(files, capsys, no_model):
    # a shell passes bytes; Python keeps the ones that are not UTF-8 as lone surrogates
    prompt = os.fsdecode(b"caf\xe9")
    line = one_error(capsys, "generate", "--model", files / "model", "--prompt", prompt)
    assert line == ("gradtape generate: error: --prompt is not valid UTF-8 text (character "
                    "3 is a byte that is not UTF-8)")


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--eval-n", "-2"], "--eval-n must be >= 1, got -2"),
    (["--backend", "tpu"], "--backend must be one of auto, numpy, cpu, cuda, cuda-bf16, "
                           "got 'tpu'"),
    (["--method", "ppo"], "--method must be one of sft, dpo, ipo, orpo, simpo, got 'ppo'"),
])
def test_demo_ranges(capsys, no_model, args, message):
    assert one_error(capsys, "demo", *args) == f"gradtape demo: error: {message}"


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_demo_out_is_checked_before_the_model_loads(tmp_path, capsys, no_model, method):
    (tmp_path / "notes.txt").write_text("someone's folder")
    line = one_error(capsys, "demo", "--method", method, "--out", tmp_path)
    assert line == (f"gradtape demo: error: --out {tmp_path} exists and is not a gradtape run "
                    "folder; choose a new or empty folder")


def test_bench_arguments(capsys, monkeypatch):
    def never(*a):
        raise AssertionError("the benchmark ran")
    monkeypatch.setattr("gradtape.cli.bench._benchmark", never)
    assert one_error(capsys, "bench", "--reps", "-1") == \
        "gradtape bench: error: --reps must be >= 0, got -1"
    line = one_error(capsys, "bench", "--workloads", "tiny-lora,huge")
    assert line == ("gradtape bench: error: --workloads: unknown workload 'huge'; known: "
                    "smollm2-lora, tiny-lora, smollm2-lora-2k, smollm2-lora-8k, llama8b-q4km-lora, "
                    "llama8b-q4km-lora-2k, smollm2-generate, smollm2-generate-avx2, "
                    "smollm2-generate-native, smollm2-full, tiny-full, smollm2-dpo, "
                    "llama8b-q4km-dpo, tiny-dpo")


def test_wrong_types_are_argparse_errors(files, tmp_path, capsys, no_model):
    line = one_error(capsys, *finetune_args(files, tmp_path / "o", "--seq-len", "many"), rc=2)
    assert line == "gradtape finetune: error: argument --seq-len: invalid int value: 'many'"


# --- one definition: FinetuneConfig checks what the CLI checks --------------------------
def test_the_python_api_gets_the_same_checks(tmp_path):
    base = dict(data="d.txt", out=str(tmp_path / "o"))
    with pytest.raises(GradtapeError, match=r"^--seq-len must be >= 2, got 0$"):
        FinetuneConfig(**base, seq_len=0)
    with pytest.raises(GradtapeError, match=r"^--lr must be > 0, got -1$"):
        FinetuneConfig(**base, lr=-1)
    with pytest.raises(GradtapeError, match=r"^--steps must be an integer, got '3'$"):
        FinetuneConfig(**base, steps="3")
    with pytest.raises(GradtapeError, match=r"^--batch-size must be an integer, got True$"):
        FinetuneConfig(**base, batch_size=True)
    with pytest.raises(GradtapeError, match=r"^--data is required$"):
        FinetuneConfig(out="o")
    with pytest.raises(GradtapeError, match=r"^--eval-frac must be in \[0, 1\), got 1$"):
        dataclasses.replace(FinetuneConfig(**base), eval_frac=1)
    # paths may be Path objects; they are kept as str (the config is written as JSON)
    cfg = FinetuneConfig(data=tmp_path / "d.txt", out=tmp_path / "o")
    assert cfg.data == str(tmp_path / "d.txt") and json.dumps(dataclasses.asdict(cfg))


def test_every_declared_range_rejects_its_bounds(capsys):
    """For each field with a numeric range: the default passes, and a value just outside
    the range fails with the field's flag in the message; the CLI's help shows it."""
    base = dict(data="d.txt", out="o")
    FinetuneConfig(**base)
    rc, help_text, _ = run_cli(capsys, "finetune", "--help")
    help_text = " ".join(help_text.split())
    assert rc == 0
    seen = 0
    for f in dataclasses.fields(FinetuneConfig):
        check = f.metadata.get("check")
        if not isinstance(check, checks.Check) or check.choices:
            continue
        seen += 1
        if check.lo is not None:
            bad = check.lo if check.lo_open else check.lo - 1
            with pytest.raises(GradtapeError, match=rf"^{flag(f.name)} must be "):
                FinetuneConfig(**base, **{f.name: bad})
        if check.hi is not None:
            bad = check.hi if check.hi_open else check.hi + 1
            with pytest.raises(GradtapeError, match=rf"^{flag(f.name)} must be "):
                FinetuneConfig(**base, **{f.name: bad})
        assert check.describe() in help_text, f.name
    assert seen >= 14


# --- the guard ----------------------------------------------------------------------------
@pytest.fixture
def broken_generate(monkeypatch):
    def run(args):
        return {}["no such key"]
    monkeypatch.setattr("gradtape.cli.generate.run", run)


def test_guard_unexpected_error_is_one_line(capsys, broken_generate, monkeypatch):
    monkeypatch.delenv("GRADTAPE_DEBUG", raising=False)
    line = one_error(capsys, "generate", "--prompt", "hi")
    assert line == ("gradtape generate: error: unexpected KeyError: 'no such key' (--debug or "
                    "GRADTAPE_DEBUG=1 shows the traceback)")


@pytest.mark.parametrize("how", ["--debug after", "--debug before", "env"])
def test_guard_debug_prints_the_traceback(capsys, broken_generate, monkeypatch, how):
    monkeypatch.delenv("GRADTAPE_DEBUG", raising=False)
    argv = ["generate", "--prompt", "hi"]
    if how == "env":
        monkeypatch.setenv("GRADTAPE_DEBUG", "1")
    argv = ["--debug", *argv] if how == "--debug before" else \
        argv + ["--debug"] if how == "--debug after" else argv
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 1
    assert "Traceback (most recent call last)" in err and "KeyError" in err
    assert err.splitlines()[-1].startswith("gradtape generate: error: unexpected KeyError")


def test_guard_os_and_memory_errors(capsys, monkeypatch):
    def full(args):
        raise OSError(28, "No space left on device", "/data/out.gguf")
    monkeypatch.setattr("gradtape.cli.generate.run", full)
    line = one_error(capsys, "generate", "--prompt", "hi")
    assert line == ("gradtape generate: error: [Errno 28] No space left on device: "
                    "'/data/out.gguf' (--debug or GRADTAPE_DEBUG=1 shows the traceback)")

    def oom(args):
        raise MemoryError
    monkeypatch.setattr("gradtape.cli.generate.run", oom)
    line = one_error(capsys, "generate", "--prompt", "hi")
    assert line.startswith("gradtape generate: error: out of memory (MemoryError)")


def test_guard_multi_line_messages_become_one_line(capsys, monkeypatch):
    def two_lines(args):
        raise GradtapeError("first\n\n  second")
    monkeypatch.setattr("gradtape.cli.generate.run", two_lines)
    assert one_error(capsys, "generate", "--prompt", "hi") == \
        "gradtape generate: error: first; second"


def test_guard_keeps_ctrl_c(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr("gradtape.cli.generate.run", interrupted)
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi")
    assert rc == 130 and err == "gradtape generate: interrupted\n"


def test_guard_a_closed_pipe_is_quiet():
    """``gradtape generate ... | head -c 1``: the reader goes away after one byte; the
    command stops quietly with 141 (128 + SIGPIPE), no message, no traceback."""
    code = ("import sys, gradtape.cli.generate as g\n"
            "def run(args):\n"
            "    for _ in range(10000):\n"
            "        print('many lines of text to fill the pipe', flush=True)\n"
            "g.run = run\n"
            "from gradtape.cli import main\n"
            "sys.exit(main(['generate', '--prompt', 'hi']))\n")
    res = subprocess.run(f"{sys.executable} -c \"$CODE\" | head -c 1", shell=True,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CODE": code}, executable="/bin/bash")
    assert res.stdout == "m" and res.stderr == "", res.stderr


def test_guard_in_a_real_process():
    """As a user sees it: a bug in a command is one line and exit status 1."""
    code = ("import sys, gradtape.cli.generate as g\n"
            "g.run = lambda args: 1 / 0\n"
            "from gradtape.cli import main\n"
            "sys.exit(main(['generate', '--prompt', 'hi']))\n")
    env = {k: v for k, v in os.environ.items() if k != "GRADTAPE_DEBUG"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 1
    assert res.stderr == ("gradtape generate: error: unexpected ZeroDivisionError: division "
                          "by zero (--debug or GRADTAPE_DEBUG=1 shows the traceback)\n")
