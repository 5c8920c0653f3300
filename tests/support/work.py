"""Bounded work, counted instead of timed: how many function calls (Python's and the C
builtins it makes) a piece of code makes in this thread, stopped past a limit.

A reader handed a hostile count (2^40 tensors, a 2^60-byte string) must refuse it
before looping over it; timing that would fail on a slow or busy machine and pass a
loop that is merely fast.  The count is the same on every CPU.
"""

from __future__ import annotations

import sys


class TooMuchWork(BaseException):
    """Past the limit (a BaseException: a reader's ``except Exception`` cannot hide it)."""


def calls_made(fn, limit):
    """``(calls, outcome)``: the calls ``fn()`` made, and its return value or the exception
    it raised (returned, not raised); ``TooMuchWork`` raised when it passes ``limit``."""
    n = 0

    def count(frame, event, arg):
        nonlocal n
        if event in ("call", "c_call"):
            n += 1
            if n > limit:
                sys.setprofile(None)
                raise TooMuchWork(f"over {limit} function calls")

    old = sys.getprofile()
    sys.setprofile(count)
    try:
        outcome = fn()
    except Exception as e:  # noqa: BLE001 (the caller checks which)
        outcome = e
    finally:
        sys.setprofile(old)
    return n, outcome
