"""Command-line options declared with their checks, and the checks of the paths commands
share (a LoRA adapter folder).

``option(parser, flag, check, ...)`` adds an argparse option and remembers its check (a
``checks.Check`` or a function ``(name, value)``), whose range also shows in ``--help``;
``check_args`` runs them all after parsing, before a command starts.  Options that come
from a config dataclass (``train.options.FinetuneConfig``) are checked by the dataclass
itself, the same check for the Python API and the CLI.
"""

from __future__ import annotations

from .. import checks
from ..models.lora import check_folder


def with_range(help_text, check):
    """``help_text`` with the check's range appended: ``... (default: 64; >= 1)``."""
    desc = check.describe() if isinstance(check, checks.Check) else ""
    if not desc:
        return help_text
    desc = desc.replace("%", "%%")
    if help_text.endswith(")") and "(default" in help_text:
        return help_text[:-1] + f"; {desc})"
    return f"{help_text} ({desc})"


def option(parser, flag, check=None, **kw):
    """``parser.add_argument(flag, **kw)``, with ``check`` run on the parsed value by
    ``check_args``."""
    if check is not None and "help" in kw:
        kw["help"] = with_range(kw["help"], check)
    action = parser.add_argument(flag, **kw)
    if check is not None:
        if not hasattr(parser, "gradtape_checks"):
            parser.gradtape_checks = []
        parser.gradtape_checks.append((flag, action.dest, check))
    return action


def check_args(parser, args):
    """Run every check declared with ``option`` on ``parser`` (an option not given and
    without a default, ``None``, is not checked)."""
    for flag, dest, check in getattr(parser, "gradtape_checks", ()):
        value = getattr(args, dest, None)
        if value is not None:
            check(flag, value)


def adapter_folder(path, name="--adapter"):
    """A PEFT LoRA folder: a readable folder holding adapter_config.json and
    adapter_model.safetensors (``models.lora.check_folder``, the check finetune's
    ``--adapter`` shares)."""
    return check_folder(path, name)
