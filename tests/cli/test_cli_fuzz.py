"""Fuzzing the command line (hypothesis): argument vectors for every command -- valid,
out-of-range and wrong-typed values, options left out or given twice, unknown options,
and existing, missing, unwritable, special and binary paths -- must either succeed or
exit non-zero with exactly one ``gradtape COMMAND: error:`` line: never a traceback, and
never the guard's line for an exception nobody foresaw (which names ``--debug``).

Commands run in-process through ``gradtape.cli.main`` on a tiny model (training takes
``--steps`` 1 or 2); ``demo`` and ``bench`` stop, once their arguments pass, where the
real model or the benchmark would start.  ``EXAMPLES`` per command (60; set
GRADTAPE_CLI_FUZZ_EXAMPLES for a deeper run).
"""

from __future__ import annotations

import collections
import io
import itertools
import os
import signal
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradtape.cli import main
from gradtape.cli.main import COMMANDS, DEBUG_HINT
from gradtape.models.lora import init_adapter

from support.filebuilders import write_tiny_gguf
from support.tinymodel import tiny_model, write_hf_folder

EXAMPLES = int(os.environ.get("GRADTAPE_CLI_FUZZ_EXAMPLES", "60"))
MAX_SECONDS = 20  # one command; a timer stops one that would hang
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


class Reached(BaseException):
    """A stand-in for the real model or benchmark: the arguments passed every check.  Not
    an ``Exception``, so the CLI's guard does not catch it."""


class Hang(BaseException):
    """A command ran past ``MAX_SECONDS`` (a failure: raised through the guard)."""


class Paths:
    """The files the fuzzer picks from: good ones and every kind of bad one."""

    def __init__(self, root: Path):
        self.root = root
        self.counter = itertools.count()
        model = tiny_model(seed=4)
        write_hf_folder(model, root / "model")
        init_adapter(model.config, rank=2, alpha=4, targets="q,v").save(root / "adapter")
        other = tiny_model(dim=48, n_heads=4, n_kv_heads=2)
        init_adapter(other.config, rank=2, targets="q").save(root / "other-adapter")
        (root / "bad-adapter").mkdir()
        (root / "bad-adapter" / "adapter_config.json").write_text("{not json")
        (root / "bad-adapter" / "adapter_model.safetensors").write_bytes(b"\0" * 16)
        write_tiny_gguf(tiny_model(seed=1, vocab=258), root / "good.gguf")
        (root / "random.gguf").write_bytes(os.urandom(3000))
        (root / "text.txt").write_text("pack my box with five dozen liquor jugs. " * 8)
        (root / "pc.jsonl").write_text("".join(
            f'{{"prompt": "q{i}? ", "completion": "a{i}"}}\n' for i in range(6)))
        (root / "chat.jsonl").write_text(
            '{"messages": [{"role": "user", "content": "hi"}, '
            '{"role": "assistant", "content": "hello"}]}\n' * 4)
        (root / "bad.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
        (root / "odd.jsonl").write_text('{"messages": []}\n')
        (root / "some.bin").write_bytes(os.urandom(2000))
        (root / "nul.txt").write_bytes(b"text\x00more")
        (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
        (root / "empty.txt").write_text("")
        (root / "run.yaml").write_text("lr: 1e-3\nwarmup: 1\nno-packing: true\n")
        (root / "bad.yaml").write_text("lr: [1e-3\n")
        (root / "list.yaml").write_text("- lr\n")
        (root / "empty-dir").mkdir()
        (root / "run").mkdir()  # shared by runs: later ones overwrite or --resume it
        (root / "foreign").mkdir()
        (root / "foreign" / "notes.txt").write_text("not a run")
        self.missing = str(root / "missing" / "nothing.txt")
        self.under_file = str(root / "text.txt" / "sub")
        # even root cannot create files in /proc; elsewhere: under a file
        self.unwritable = ("/proc/gradtape-fuzz" if Path("/proc/self").is_dir() else
                           str(root / "text.txt" / "unwritable"))

    def p(self, name):
        return str(self.root / name)

    def fresh(self, suffix=""):
        return str(self.root / "outs" / f"o{next(self.counter)}{suffix}")

    # -- pools: (good, bad) ---------------------------------------------------------------
    def models(self):
        return (st.sampled_from([self.p("model"), self.p("good.gguf")]),
                st.sampled_from([self.p("random.gguf"), self.p("adapter"), self.p("text.txt"),
                                 self.p("empty-dir"), self.missing, "/dev/null"]))

    def data(self):
        return (st.sampled_from([self.p("text.txt"), self.p("pc.jsonl"), self.p("chat.jsonl"),
                                 "/proc/self/status"]),
                st.sampled_from([self.p("bad.jsonl"), self.p("odd.jsonl"), self.p("some.bin"),
                                 self.p("nul.txt"), self.p("latin1.txt"), self.p("empty.txt"),
                                 self.p("empty-dir"), self.missing, self.under_file,
                                 "/dev/null", ""]))

    def adapters(self):
        return (st.just(self.p("adapter")),
                st.sampled_from([self.p("other-adapter"), self.p("bad-adapter"),
                                 self.p("model"), self.p("text.txt"), self.missing, ""]))

    def out_folders(self):
        return (st.one_of(st.builds(self.fresh), st.just(self.p("run"))),
                st.sampled_from([self.p("foreign"), self.p("text.txt"), self.under_file,
                                 self.unwritable, self.unwritable + "/deeper", "/dev/null",
                                 ""]))

    def out_files(self):
        return (st.builds(self.fresh, st.just(".gguf")),
                st.sampled_from([self.p("empty-dir"), self.under_file + ".gguf",
                                 self.unwritable + ".gguf", "/dev/null", self.missing + ".gguf",
                                 ""]))


# --- values: (good, bad) pairs; a bad value is out of range or of the wrong type ---------
WRONG = st.sampled_from(["", "x", "1.5", "1e3", "--", "0x10", "one", " 2", "∞"])


def ints(lo, hi, bad_lo=-3):
    """Integers in [lo, hi]; bad: just below the range, or not an integer."""
    low = st.integers(bad_lo, lo - 1).map(str) if bad_lo < lo else WRONG
    return st.integers(lo, hi).map(str), st.one_of(low, WRONG)


def floats(lo, hi, bad=("-1", "nan", "inf", "-inf")):
    return st.floats(lo, hi).map(repr), st.one_of(st.sampled_from(bad), WRONG)


def choice(good, bad):
    return st.sampled_from(good), st.sampled_from(bad)


def text():
    return (st.text(min_size=1, max_size=30),
            st.sampled_from(["x" * 600, os.fsdecode(b"caf\xe9"), ""]))


def also(pair, *extra):
    """``pair`` with more good values, drawn one time in ten (extremes, mostly)."""
    return st.one_of(*[pair[0]] * 9, *extra), pair[1]


SPECS = {
    # option -> (good values, bad values), or None for a switch; "!": (nearly) always given
    "finetune": lambda P: {
        "!--model": P.models(), "!--data": P.data(), "!--out": P.out_folders(),
        # "!" here too: the defaults (a whole epoch of 4 x 256 tokens) take seconds
        "!--steps": also(ints(1, 2), st.just("0")),  # 0: as many as --epochs says
        "!--epochs": floats(0.001, 0.02, ("0", "-1", "nan", "inf")),
        "!--seq-len": also(ints(2, 16, bad_lo=-1), st.just("100000")),
        "!--batch-size": ints(1, 3, bad_lo=-1),
        "--grad-accum": ints(1, 2, bad_lo=-1), "--rank": ints(1, 4, bad_lo=-1),
        "--alpha": also(floats(0.5, 64, ("0", "-2", "nan", "inf")), st.just("1e300")),
        "--targets": choice(["q", "q,v", "all", "o,down", "q_proj"], ["", "q,zz", ",", "ALL"]),
        "--lr": also(floats(1e-5, 1e-2, ("0", "-1", "nan", "inf")), st.just("1e30")),
        "--warmup": ints(0, 5),
        "--weight-decay": also(floats(0, 0.1, ("-0.1", "nan")), st.just("1e30")),
        "--clip": floats(0, 2, ("-1", "nan", "inf")),
        "--eval-frac": floats(0, 0.5, ("1", "1.5", "-0.1", "nan")),
        "--eval-every": ints(0, 3), "--save-every": ints(1, 3, bad_lo=-1),
        "--seed": also(ints(0, 5), st.just(str(2 ** 70))),
        "--backend": choice(["numpy"], ["gpu", "", "cuda"]),
        "--dtype": choice(["float32", "float64"], ["float16", "f32"]),
        "--early-stop": ints(0, 2, bad_lo=-1),
        "--samples": also(ints(0, 2, bad_lo=-1), st.just("65")),
        "--sample-tokens": ints(1, 3, bad_lo=-1),
        "--sample-prompts": (st.just(P.p("text.txt")),
                             st.sampled_from([P.p("bad.jsonl"), P.p("empty.txt"), P.missing,
                                              P.p("empty-dir")])),
        "--config": (st.sampled_from([P.p("run.yaml")]),
                     st.sampled_from([P.p("bad.yaml"), P.p("list.yaml"), P.p("text.txt"),
                                      P.missing, P.p("empty-dir")])),
        "--resume": None,
    },
    "generate": lambda P: {
        "--model": P.models(), "!--prompt": text(), "--chat": None,
        "--adapter": P.adapters(),
        "--max-new-tokens": also(ints(1, 4), st.just("10000")),
        # from 0.01: below about 1e-308 the sampler's logits / temperature overflow (a
        # known problem of the sampling code, outside the command line's checks)
        "--temperature": also(floats(0.01, 2, ("-0.5", "nan", "inf")), st.just("0")),
        "--top-p": floats(0.01, 1, ("0", "1.5", "-1", "nan")),
        "--seed": also(ints(0, 9), st.just(str(2 ** 70))),
        "--dtype": choice(["float32", "float64"], ["float16"]),
    },
    "merge": lambda P: {
        "--model": P.models(), "!--adapter": P.adapters(),
        "!--out": (st.one_of(P.out_folders()[0], P.out_files()[0]),
                   st.one_of(P.out_folders()[1], P.out_files()[1])),
        "--format": choice(["hf", "gguf"], ["onnx"]),
        "--dtype": choice(["float32", "float16"], ["int8"]),
    },
    "export-gguf-lora": lambda P: {
        "--model": P.models(), "!--adapter": P.adapters(), "!--out": P.out_files(),
        "--outtype": choice(["f32", "f16"], ["q8_0"]),
    },
    "demo": lambda P: {
        "--out": P.out_folders(), "--steps": ints(1, 50), "--eval-n": ints(1, 30),
        "--backend": choice(["auto", "numpy", "cpu"], ["tpu", ""]),
        "--method": choice(["sft", "dpo", "simpo"], ["ppo", ""]),
    },
    "bench": lambda P: {
        "--json": None, "--with-compile": None,
        "--workloads": choice(["tiny-lora", "smollm2-lora,tiny-lora"], ["huge", "", "tiny-lora,"]),
        "--backend": choice(["cpu", "numpy"], ["tpu"]), "--reps": ints(0, 3),
    },
}
BAD_VALUE = 6  # percent: with about ten options given, about half the runs are valid
BAD_PATH = 25


@st.composite
def argvs(draw, command, paths):
    """An argument vector.  Every choice is drawn so that hypothesis's simplest draw (0)
    is the ordinary one (present, good, given once), which keeps the mix near
    ``BAD_VALUE`` / ``BAD_PATH`` rather than at the corner cases."""
    spec = SPECS[command](paths)
    argv = [command]
    for name, values in draw(st.permutations(list(spec.items()))):
        required, opt = name.startswith("!"), name.lstrip("!")
        if values is None:  # a switch (--resume, --chat, ...): now and then
            if draw(st.integers(0, 99)) >= 85:
                argv.append(opt)
            continue
        if draw(st.integers(0, 99)) >= (97 if required else 50):
            continue  # left out (a "!" option: now and then)
        is_path = opt in ("--model", "--data", "--out", "--adapter")
        bad = draw(st.integers(0, 99)) >= 100 - (BAD_PATH if is_path else BAD_VALUE)
        argv += [opt, draw(values[bad])]
        if draw(st.integers(0, 40)) == 40:  # given twice: the last one counts
            argv += [opt, draw(values[0])]
    if draw(st.integers(0, 40)) == 40:
        argv.append("--no-such-option")
    if draw(st.integers(0, 40)) == 40 and len(argv) > 1 and argv[-2].startswith("--"):
        argv.pop()  # an option without its value
    return argv


def run(argv):
    """(exit status or "reached", stderr) of ``gradtape ARGV`` in this process, its
    standard input empty (``generate`` without --prompt reads the chat from it; pytest's
    own stdin refuses reads)."""
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _hang)
    signal.setitimer(signal.ITIMER_REAL, MAX_SECONDS)
    try:
        with redirect_stdout(out), redirect_stderr(err), \
                mock.patch("sys.stdin", io.StringIO("")), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                status = main(argv)
            except SystemExit as e:  # argparse
                status = e.code
            except Reached:
                status = "reached"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    # a warning a user would see (NumPy's overflow warnings print source lines, which
    # read like a traceback); other libraries' deprecation notices do not count
    shown = [f"{w.category.__name__}: {w.message}" for w in caught
             if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))]
    assert not shown, (argv, shown)
    return status, err.getvalue()


def _hang(*_):
    raise Hang


def check_outcome(command, argv, status, err):
    assert "Traceback" not in err, (argv, err)
    assert DEBUG_HINT not in err, ("an exception nobody foresaw", argv, err)
    if status in (0, "reached"):
        return "ok"
    assert status in (1, 2), (argv, status, err)
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, (argv, err)
    assert lines[0].startswith(f"gradtape {command}: error: "), (argv, err)
    return "usage error" if status == 2 else "error"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return Paths(tmp_path_factory.mktemp("cli_fuzz"))


@pytest.fixture
def stand_ins(monkeypatch, paths):
    """The real SmolLM2 and the benchmark are not loaded: reaching them is success; the
    loss curve is not drawn.  Runs happen in the fuzz folder (demo's default --out is
    relative)."""
    from gradtape import models

    real = models.load

    def load(name="smollm2", **kw):
        if str(name) == "smollm2":
            raise Reached
        return real(name, **kw)

    def benchmark(*a):
        raise Reached

    def plot_losses(records, path):  # matplotlib: most of a tiny run's time
        Path(path).write_bytes(b"")

    monkeypatch.setattr(models, "load", load)
    monkeypatch.setattr("gradtape.cli.bench._benchmark", benchmark)
    monkeypatch.setattr("gradtape.train.finetune.plot_losses", plot_losses)
    monkeypatch.chdir(paths.root)
    monkeypatch.delenv("GRADTAPE_DEBUG", raising=False)


@pytest.mark.slow  # EXAMPLES commands each
@pytest.mark.parametrize("command", list(SPECS))
def test_fuzz_command_line(command, paths, stand_ins):
    seen, slowest = collections.Counter(), []

    @FUZZ
    @given(st.data())
    def one(data):
        argv = data.draw(argvs(command, paths))
        t = time.perf_counter()
        status, err = run(argv)
        slowest.append((time.perf_counter() - t, argv))
        seen[check_outcome(command, argv, status, err)] += 1

    one()
    print(command, dict(seen), sorted(slowest, key=lambda x: x[0])[-3:])  # pytest -s


def test_the_fuzzer_reaches_success_and_every_kind_of_error(paths, stand_ins):
    """The generators can produce a valid run of each command and the errors the issue
    lists (a sanity check of the fuzzer, not of the commands); every command is fuzzed."""
    assert set(SPECS) == set(COMMANDS)
    P = paths
    cases = [
        (["finetune", "--model", P.p("model"), "--data", P.p("text.txt"), "--out",
          P.fresh(), "--steps", "1", "--seq-len", "8", "--batch-size", "1"], 0),
        (["generate", "--model", P.p("model"), "--prompt", "hi", "--max-new-tokens", "2",
          "--adapter", P.p("adapter")], 0),
        (["generate", "--chat", "--model", P.p("model"), "--seed", "0"], 0),  # stdin empty
        (["merge", "--model", P.p("model"), "--adapter", P.p("adapter"), "--out",
          P.fresh(".gguf")], 0),
        (["export-gguf-lora", "--model", P.p("model"), "--adapter", P.p("adapter"), "--out",
          P.fresh(".gguf")], 0),
        (["demo", "--out", P.fresh()], "reached"),
        (["bench", "--workloads", "tiny-lora"], "reached"),
        (["finetune", "--model", P.p("model"), "--data", P.p("some.bin"), "--out",
          P.fresh()], 1),
        (["finetune", "--model", P.p("model"), "--data", P.p("text.txt"), "--out",
          P.unwritable], 1),
        (["finetune", "--data", P.p("text.txt"), "--out", P.fresh(), "--seq-len", "x"], 2),
    ]
    for argv, expected in cases:
        status, err = run(argv)
        assert status == expected, (argv, err)
        check_outcome(argv[0], argv, status, err)
