"""Training records: the files people have, read and checked into one normal form.

Files: plain text; JSON Lines (``.jsonl``, or text that starts with ``{``); a JSON array
(``.json``; a ``.json`` file holding JSON Lines, as dataset tools write them, is read as
such); Parquet (``.parquet``, read with pyarrow, as Hugging Face datasets store them); a
dataset folder as the Hub downloads it (its ``data/`` files, or the folder's own, of one
split: ``train-00000-of-00001.parquet``, ``train/0000.parquet``, ``train.jsonl``).

Schemas, one table (``SCHEMAS``), detected from the first record (a Parquet file's
columns, then its first row) and required of every record after it.  A reader call says
which task it reads for (``TASKS``): ``sft`` takes OpenAI chat ``messages``, ShareGPT
``conversations``, Alpaca ``instruction``/``input``/``output``, ``prompt``/``completion``
and ``text``; ``preference`` takes TRL's pairs: ``prompt``/``chosen``/``rejected`` as
strings (standard) or message lists (conversational), and ``chosen``/``rejected`` alone
(the implicit prompt: the part both share, as TRL's ``extract_prompt`` finds it).  Each
row's ``normal`` turns a record into one of the forms the tokenizer side knows
(``KINDS``): ``chat`` (``{"messages": [{"role", "content"}]}``), ``completion``
(``{"prompt", "completion"}``), ``text`` (``{"text"}``), ``pair`` (``{"prompt",
"chosen", "rejected"}`` strings) and ``chat pair`` (the same three as message lists, the
completions assistant turns only).  Other field names map onto the schema's with
``--columns prompt=question,completion=answer``.

Everything here runs before a model is loaded: a bad record is one line naming the file
and the record (``f.jsonl:7``, ``f.json: record 7``, ``f.parquet: row 7``).  This module
knows nothing of tokens (``data`` does).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..checks import input_path
from ..errors import GradtapeError

SFT_KINDS = ("chat", "completion", "text")
PAIR_KINDS = ("pair", "chat pair")
KINDS = SFT_KINDS + PAIR_KINDS
TASKS = {"sft": SFT_KINDS, "preference": PAIR_KINDS}  # what a reader asks for -> its kinds
TASK_NAMES = {"sft": "SFT data", "preference": "preference pairs"}


# --- the schemas ----------------------------------------------------------------------------

def _string(obj, key, where, optional=False):
    """``obj[key]`` as a string: missing or null is ``""`` where ``optional``."""
    v = obj.get(key)
    if v is None and optional:
        return ""
    if not isinstance(v, str):
        raise GradtapeError(f"{where}: {key!r} must be a string, got "
                            f"{'null' if v is None else type(v).__name__}")
    return v


def _chat(msgs, where):
    if not any(m["role"] == "assistant" for m in msgs):
        raise GradtapeError(f"{where}: no assistant message to learn from")
    return {"messages": msgs}


def _turns(obj, key, who, what, where):
    """``obj[key]``, checked to be a non-empty list of ``{who: str, what: str}``."""
    turns = obj[key]
    if not (isinstance(turns, list) and turns and all(
            isinstance(t, dict) and isinstance(t.get(who), str)
            and isinstance(t.get(what), str) for t in turns)):
        raise GradtapeError(f"{where}: {key!r} must be a non-empty list of "
                            f"{{\"{who}\": str, \"{what}\": str}}")
    return turns


def _messages(obj, where):
    msgs = _turns(obj, "messages", "role", "content", where)
    return _chat([{"role": m["role"], "content": m["content"]} for m in msgs], where)


# ShareGPT speakers -> chat roles (the names seen in the files that circulate)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "system": "system"}


def _sharegpt(obj, where):
    turns = _turns(obj, "conversations", "from", "value", where)
    bad = next((t["from"] for t in turns if t["from"] not in SHAREGPT_ROLES), None)
    if bad is not None:
        raise GradtapeError(f"{where}: unknown speaker {bad!r} in 'conversations' (accepted: "
                            f"{', '.join(SHAREGPT_ROLES)})")
    system = _string(obj, "system", where, optional=True)
    msgs = [{"role": "system", "content": system}] if system else []
    return _chat(msgs + [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
                         for t in turns], where)


def _alpaca(obj, where):
    """The instruction, and the input below it when there is one, are the user's turn;
    the output is the assistant's."""
    instruction, output = _string(obj, "instruction", where), _string(obj, "output", where)
    extra = _string(obj, "input", where, optional=True)
    system = _string(obj, "system", where, optional=True)
    msgs = [{"role": "system", "content": system}] if system else []
    return _chat(msgs + [{"role": "user", "content": instruction + ("\n\n" + extra if extra
                                                                     else "")},
                         {"role": "assistant", "content": output}], where)


def _prompt_completion(obj, where):
    if not (isinstance(obj["prompt"], str) and isinstance(obj["completion"], str)):
        raise GradtapeError(f"{where}: 'prompt' and 'completion' must be strings")
    return {"prompt": obj["prompt"], "completion": obj["completion"]}


def _text(obj, where):
    return {"text": _string(obj, "text", where)}


# --- preference pairs -----------------------------------------------------------------------

def _completion_turns(obj, key, where):
    """``obj[key]``: a non-empty list of assistant messages with some text."""
    turns = _turns(obj, key, "role", "content", where)
    bad = next((i for i, m in enumerate(turns, 1) if m["role"] != "assistant"), None)
    if bad is not None:
        raise GradtapeError(f"{where}: {key!r} must be assistant turns; its message {bad} "
                            f"is {turns[bad - 1]['role']!r}")
    if not any(m["content"] for m in turns):
        raise GradtapeError(f"{where}: {key!r} is empty: no completion to score")
    return [{"role": m["role"], "content": m["content"]} for m in turns]


def _distinct(pair, where):
    if pair["chosen"] == pair["rejected"]:
        raise GradtapeError(f"{where}: 'chosen' and 'rejected' are the same: nothing to "
                            "prefer")
    return pair


def _pair_text(obj, where):
    """TRL's standard form: three strings."""
    pair = {k: _string(obj, k, where) for k in ("prompt", "chosen", "rejected")}
    for k in ("chosen", "rejected"):
        if not pair[k]:
            raise GradtapeError(f"{where}: {k!r} is empty: no completion to score")
    return _distinct(pair, where)


def _pair_chat(obj, where):
    """TRL's conversational form: the prompt's messages, then each completion's."""
    prompt = _turns(obj, "prompt", "role", "content", where)
    return _distinct({"prompt": [{"role": m["role"], "content": m["content"]}
                                 for m in prompt],
                      "chosen": _completion_turns(obj, "chosen", where),
                      "rejected": _completion_turns(obj, "rejected", where)}, where)


def shared_prefix(chosen, rejected):
    """The length of the implicit prompt, as TRL's ``extract_prompt`` finds it: up to the
    first item (character or message) where the two differ, less a space that ends it
    (the space begins the completions); None where they never differ (one is the other's
    beginning, and TRL would take its last item for a completion: refused instead)."""
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            return idx - 1 if idx and chosen[idx - 1] == " " else idx
    return None


def _implicit(obj, where, make):
    """``make`` applied to the pair with the prompt both completions share split off."""
    chosen, rejected = obj["chosen"], obj["rejected"]
    if chosen == rejected:
        raise GradtapeError(f"{where}: 'chosen' and 'rejected' are the same: nothing to "
                            "prefer")
    n = shared_prefix(chosen, rejected)
    if n is None:
        short = "chosen" if len(chosen) < len(rejected) else "rejected"
        raise GradtapeError(f"{where}: {short!r} is the beginning of the other: nothing "
                            "follows the prompt they share in it (an empty completion)")
    if n == 0:
        raise GradtapeError(f"{where}: 'chosen' and 'rejected' share no prompt (they "
                            "differ from the start); give it as 'prompt'")
    return make({"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]},
                where)


def _implicit_text(obj, where):
    for k in ("chosen", "rejected"):
        _string(obj, k, where)
    return _implicit(obj, where, _pair_text)


def _implicit_chat(obj, where):
    # a "prompt" string beside conversations (UltraFeedback-binarized) only repeats the
    # first user turn: the prompt is the conversations' shared messages, as TRL's
    # maybe_extract_prompt decides
    for k in ("chosen", "rejected"):
        _turns(obj, k, "role", "content", where)
    return _implicit(obj, where, _pair_chat)


def _is_list(v):
    return isinstance(v, list)


@dataclass(frozen=True)
class Schema:
    name: str  # as the run's first lines state it
    keys: tuple  # fields every record has (what detection looks for)
    optional: tuple  # fields a record may have
    kind: str  # one of KINDS: how ``data`` tokenizes the normal form
    normal: object  # (record, where) -> the kind's normal form, or a one-line error
    # (record) -> whether a record with these keys has this schema's value types (a
    # preference record is standard or conversational by its values); None: any
    form: object = None

    @property
    def task(self):
        return next(t for t, kinds in TASKS.items() if self.kind in kinds)


# first match wins: a record with both "messages" and "text" is a chat
SCHEMAS = (
    Schema("OpenAI chat", ("messages",), (), "chat", _messages),
    Schema("ShareGPT", ("conversations",), ("system",), "chat", _sharegpt),
    Schema("Alpaca", ("instruction", "output"), ("input", "system"), "chat", _alpaca),
    Schema("prompt/completion", ("prompt", "completion"), (), "completion",
           _prompt_completion),
    Schema("text", ("text",), (), "text", _text),
    Schema("TRL preference, conversational", ("prompt", "chosen", "rejected"), (),
           "chat pair", _pair_chat, lambda r: _is_list(r.get("prompt"))),
    Schema("TRL preference", ("prompt", "chosen", "rejected"), (), "pair", _pair_text,
           lambda r: not _is_list(r.get("prompt")) and not _is_list(r.get("chosen"))),
    Schema("implicit prompt, conversational", ("chosen", "rejected"), ("prompt",),
           "chat pair", _implicit_chat,
           lambda r: _is_list(r.get("chosen")) and not _is_list(r.get("prompt"))),
    Schema("implicit prompt", ("chosen", "rejected"), (), "pair", _implicit_text,
           lambda r: isinstance(r.get("chosen"), str) and "prompt" not in r),
)
FIELDS = tuple(dict.fromkeys(k for s in SCHEMAS for k in s.keys + s.optional))


def accepted(task):
    """The schemas a task takes, as error messages list them."""
    return "; ".join(f"{'+'.join(s.keys)} ({s.name})" for s in SCHEMAS if s.task == task)


_ACCEPTED = accepted("sft")


def parse_columns(value, name="--columns") -> dict:
    """``"prompt=question,completion=answer"`` -> ``{"question": "prompt", "answer":
    "completion"}`` (the file's name -> the schema's)."""
    if not value:
        return {}
    out = {}
    for item in value.split(","):
        field, sep, column = (s.strip() for s in item.partition("="))
        if not sep or not field or not column:
            raise GradtapeError(f"{name}: {item.strip()!r} is not FIELD=COLUMN (e.g. "
                                "prompt=question,completion=answer)")
        if field not in FIELDS:
            raise GradtapeError(f"{name}: unknown field {field!r}; fields are "
                                f"{', '.join(FIELDS)}")
        if field in out.values() or column in out:
            raise GradtapeError(f"{name}: {field!r} or {column!r} is mapped twice")
        out[column] = field
    return out


def check_columns(name, value):
    """The ``--columns`` option's check (a ``checks`` function)."""
    from ..checks import check_type
    check_type(name, value, str)
    parse_columns(value, name)


def _matching(names, task):
    return [s for s in SCHEMAS if s.task == task and all(k in names for k in s.keys)]


def _pick(found, record):
    """The first schema of ``found`` whose value types ``record`` has (None: not known,
    a Parquet file's columns), else the first."""
    if record is None:
        return found[0]
    return next((s for s in found if s.form is None or s.form(record)), found[0])


def detect(keys, where, columns, what="keys", task="sft", record=None) -> Schema:
    """The ``task``'s schema of a record with these ``keys`` (after ``columns`` renamed
    them; a Parquet file's columns, ``what="columns"``): the first whose keys it has and,
    given the (renamed) ``record``, whose value types it has, else the first whose keys
    it has (its ``normal`` then says what is wrong)."""
    names = {columns.get(k, k) for k in keys}
    found = _matching(names, task)
    if found:
        return _pick(found, record)
    shown = ", ".join(map(repr, keys)) or "(none)"
    if task == "preference" and {"chosen", "rejected"} & names:
        lacking = "rejected" if "chosen" in names else "chosen"
        raise GradtapeError(f"{where}: a preference pair needs 'chosen' and 'rejected'; "
                            f"{lacking!r} is missing (the {what} are {shown})")
    other = next(t for t in TASKS if t != task)
    theirs = _matching(names, other)
    if theirs:
        their = _pick(theirs, record).name
        raise GradtapeError(f"{where}: {TASK_NAMES[other]} ({their}: the {what} are "
                            f"{shown}), where {TASK_NAMES[task]} are wanted; accepted: "
                            f"{accepted(task)}")
    missing = [c for c in columns if c not in keys]
    hint = f"--columns maps {missing[0]!r}, which is not among them; " if missing else ""
    example = ("prompt=question,completion=answer" if task == "sft"
               else "chosen=good,rejected=bad")
    raise GradtapeError(f"{where}: unknown schema: the {what} are "
                        f"{shown}; {hint}accepted: "
                        f"{accepted(task)} (other names map with --columns, e.g. --columns "
                        f"{example})")


def _normal(schema, obj, where, columns):
    """One record in its schema's normal form (``obj`` as read, ``columns`` renaming)."""
    if columns:
        obj = {columns.get(k, k): v for k, v in obj.items()}
    lacking = [k for k in schema.keys if k not in obj]
    if lacking:
        raise GradtapeError(f"{where}: expected the {schema.name} fields "
                            f"{', '.join(schema.keys)} like the first record; "
                            f"{lacking[0]!r} is missing (keys: "
                            f"{', '.join(map(repr, obj)) or 'none'})")
    if schema.form is not None and not schema.form(obj):
        other = next((s for s in _matching(obj, schema.task)
                      if s is not schema and s.form is not None and s.form(obj)), None)
        if other is not None:
            raise GradtapeError(f"{where}: a {other.name} record, but the first record is "
                                f"{schema.name}: the schema changes mid-file")
    rec = schema.normal(obj, where)
    for t in _strings(rec):  # JSON may escape a lone surrogate ("\\ud800"): not text
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise GradtapeError(f"{where}: a string holds an unpaired surrogate "
                                "escape (\\ud800-\\udfff), which is not text") from None
    return rec


def _strings(rec):
    for v in rec.values():
        if isinstance(v, str):
            yield v
        else:  # messages
            for m in v:
                yield m["role"]
                yield m["content"]


# --- files ------------------------------------------------------------------------------

@dataclass(frozen=True)
class DataFile:
    """A data file (or a dataset folder's split) read and checked before any model is
    loaded: plain ``text``, or ``records``, ``(where, normal form)`` pairs of ``schema``."""
    path: Path
    text: str = ""
    records: tuple = ()
    schema: Schema | None = None
    files: tuple = ()  # a folder's files, in reading order

    def describe(self) -> str:
        """One line for the run's start: what was read and how it will be trained on."""
        if self.schema is None:
            return f"{self.path}: plain text, {len(self.text):,} characters"
        s = self.schema
        fields = ", ".join(s.keys + tuple(f"[{k}]" for k in s.optional))
        where = (f"{self.path} ({len(self.files)} file{'s' * (len(self.files) != 1)})"
                 if self.files else str(self.path))
        return f"{where}: {len(self.records):,} records, {s.name} ({fields})"


PARQUET_MAGIC = b"PAR1"
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
# a dataset folder's split names, as file or folder names begin; the eval split is the
# first of these that a folder has
SPLITS = {"train": "train", "training": "train", "validation": "validation",
          "valid": "validation", "val": "validation", "dev": "validation", "eval": "validation",
          "test": "test"}
EVAL_SPLITS = ("validation", "test")


def read_data(path, name="data file", columns="", split="train", task="sft") -> DataFile:
    """Read and check data (``name`` is how messages call it, ``columns`` the
    ``--columns`` mapping): a file, or a dataset folder's ``split`` ("train", or "eval":
    its validation split, else its test split), for ``task`` (``TASKS``: "sft", or
    "preference": pairs only; the other task's records are refused naming the schemas
    accepted)."""
    if task not in TASKS:
        raise ValueError(f"read_data: task must be one of {', '.join(TASKS)}, got {task!r}")
    path = input_path(path, name, "file or folder")
    cols = parse_columns(columns)
    if path.is_dir():
        return _read_folder(path, name, cols, split, task)
    data = _read_file(path, name, cols, task)
    if data.schema is None and task != "sft":
        raise GradtapeError(f"{name} {path}: plain text, where {TASK_NAMES[task]} are "
                            f"wanted (JSON Lines, a JSON array or Parquet); accepted: "
                            f"{accepted(task)}")
    return data


def _read_file(path, name, cols, task, schema=None):
    raw = _read_bytes(path, name)
    if raw.startswith(PARQUET_MAGIC) or path.suffix == ".parquet":
        return _read_parquet(path, raw, name, cols, task, schema)
    text = _utf8(raw, path, name)
    start = text.lstrip()[:1]
    if path.suffix == ".json" and start == "[":
        objs = _json_array(text, path)
    elif path.suffix in (".jsonl", ".json") or start == "{":
        objs = _jsonl_records(text, path)
    else:
        return DataFile(path, text=text)
    return _checked(path, objs, cols, task, schema)


def _read_bytes(path, name):
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise GradtapeError(f"{name} {path}: cannot be read ({e.strerror or e})") from None
    return raw


def _utf8(raw, path, name):
    """The file as text: UTF-8 without NUL bytes (else: the byte offset and line of the
    first bad byte), not empty, a byte-order mark dropped."""
    try:
        text = raw.decode("utf-8")
        bad = raw.find(b"\0")  # valid UTF-8, but no text has it: a binary file
        what, why = "not text", "a NUL byte"
    except UnicodeDecodeError as e:
        bad, what, why = e.start, "not UTF-8 text", f"byte 0x{raw[e.start]:02x}"
    if bad >= 0:
        line = raw.count(b"\n", 0, bad) + 1
        raise GradtapeError(f"{name} {path}: {what} ({why} at byte offset {bad}, line "
                            f"{line}); data must be UTF-8 text, JSON Lines, a JSON array "
                            "or Parquet")
    text = text.removeprefix("\ufeff")  # a byte-order mark is not part of the text
    if not text.strip():
        raise GradtapeError(f"{name} {path}: is empty")
    return text


def _checked(path, objs, cols, task, schema):
    """``DataFile`` of (where, record) pairs: the schema from the first record (or the
    one given: another file of the same folder), every record in its normal form."""
    records = []
    for where, obj in objs:
        if schema is None:
            schema = detect(list(obj), where, cols, task=task,
                            record={cols.get(k, k): v for k, v in obj.items()})
        records.append((where, _normal(schema, obj, where, cols)))
    if not records:
        raise GradtapeError(f"{path}: holds no records")
    return DataFile(path, records=tuple(records), schema=schema)


def _jsonl_records(text, path):
    # JSON Lines end at "\n" only: str.splitlines would also split at U+2028 and other
    # characters that are valid inside a JSON string, and misnumber the lines
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise GradtapeError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise GradtapeError(f"{where}: JSON nested too deeply") from None
        if not isinstance(obj, dict):
            raise GradtapeError(f"{where}: each line must be a JSON object")
        yield where, obj


def _json_array(text, path):
    try:
        objs = json.loads(text)
    except json.JSONDecodeError as e:
        raise GradtapeError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column "
                            f"{e.colno})") from None
    except RecursionError:
        raise GradtapeError(f"{path}: JSON nested too deeply") from None
    if not isinstance(objs, list):
        raise GradtapeError(f"{path}: expected a JSON array of records (or JSON Lines)")
    for n, obj in enumerate(objs, 1):
        if not isinstance(obj, dict):
            raise GradtapeError(f"{path}: record {n}: each record must be a JSON object")
        yield f"{path}: record {n}", obj


def _read_parquet(path, raw, name, cols, task, schema):
    """A Parquet file's records: the schema from its columns (and first row, where the
    columns fit more than one); only the columns those schemas use are read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(pa.BufferReader(raw))
        names = pf.schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        raise GradtapeError(f"{name} {path}: not a readable Parquet file ({e})") from None
    first = detect(names, f"{path}", cols, what="columns", task=task)
    fits = _matching({cols.get(c, c) for c in names}, task)
    if schema is not None and schema not in fits:  # another file's
        raise GradtapeError(f"{path}: expected the {schema.name} columns "
                            f"{', '.join(schema.keys)} like the first file; the columns are "
                            f"{', '.join(map(repr, names))}")
    to_file = {f: c for c, f in cols.items()}  # the schema's names -> the file's
    used = [schema] if schema is not None else fits if first.form else [first]
    wanted = {k: to_file.get(k, k) for s in used for k in s.keys + s.optional}
    wanted = {k: c for k, c in wanted.items() if c in names}
    try:
        table = pf.read(columns=list(wanted.values()))
    except (pa.ArrowException, OSError) as e:
        raise GradtapeError(f"{name} {path}: cannot be read as Parquet ({e})") from None
    data = {k: table.column(c).to_pylist() for k, c in wanted.items()}
    objs = ((f"{path}: row {i + 1}", {k: v[i] for k, v in data.items()})
            for i in range(table.num_rows))
    # the records carry the schema's own names now: no renaming left to do
    return _checked(path, objs, {}, task, schema)


def split_of(rel: Path):
    """The split a dataset file belongs to, from the first of its path's parts (folders,
    then the file name) that begins with a split name; None if none does."""
    for part in rel.parts:
        m = re.match(r"([a-z]+)(?:[-_.]|$)", part.lower())
        if m and m.group(1) in SPLITS:
            return SPLITS[m.group(1)]
    return None


def _read_folder(path, name, cols, split, task):
    root = path / "data" if (path / "data").is_dir() else path
    found = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root)
        if f.suffix not in DATA_SUFFIXES or not f.is_file() or any(
                p.startswith(".") for p in rel.parts):
            continue
        s = split_of(rel)
        if s is None and f.suffix == ".json":  # config.json and the like: not data
            continue
        found.setdefault(s, []).append(f)
    if not found:
        raise GradtapeError(f"{name} {path}: a folder with no data files (*.parquet, "
                            "*.jsonl, or split-named *.json, in it or in its data/)")
    named = [s for s in found if s is not None]
    if split == "train":
        pick = "train" if named else None
    else:
        pick = next((s for s in EVAL_SPLITS if s in found), None)
    if pick not in found:
        want = "train split" if split == "train" else "validation or test split"
        raise GradtapeError(f"{name} {path}: has no {want} (splits found: "
                            f"{', '.join(sorted(named))})")
    parts, schema = [], None
    for f in found[pick]:
        part = _read_file(f, name, cols, task, schema)
        if part.schema is None:
            raise GradtapeError(f"{name} {f}: not records (a dataset folder's files hold "
                                "JSON Lines, a JSON array or Parquet)")
        schema = part.schema
        parts.append(part)
    return DataFile(path, records=tuple(r for p in parts for r in p.records), schema=schema,
                    files=tuple(found[pick]))
