"""Data-parallel training across processes with MPI: who this process is, and the
collectives the fine-tuner needs.

``world()`` tells whether we run under ``mpiexec`` (from the launcher's environment, so
mpi4py is never imported otherwise) and returns a ``World``: rank, size, and the few
collectives training uses.  One process (no launcher, or ``mpiexec -n 1``) gets the
single-process ``World`` whose collectives are no-ops.

What travels per optimizer step is ONE ``Allreduce`` (sum) on ONE contiguous vector:
every adapter gradient flattened, then the step's loss, then a stop flag (see
``TrainStep``).  Everything else a rank needs is either a pure function it computes
itself (the batch order, hence each shard and the step's target-token count) or the same
on every rank by construction (the update, since every rank applies it to the same
reduced gradient).  This module is not a general communication layer: no NCCL, no
point-to-point messages.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

from .. import settings
from ..errors import GradtapeError

# set by the common launchers in every rank: MPICH/Intel MPI (hydra: PMI_*), Open MPI
# (OMPI_COMM_WORLD_*), PMIx launchers
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_OTHER_VARS = ("MPI_LOCALNRANKS", "PMI_FD", "PMIX_NAMESPACE")


def launched_size(environ=None):
    """How many ranks the launcher started: None when not under a launcher, 0 when it is
    one but the size is not in the environment."""
    env = settings.launcher() if environ is None else environ
    for var in _SIZE_VARS:
        if env.get(var, "").isdigit():
            return int(env[var])
    if any(var in env for var in _RANK_VARS + _OTHER_VARS):
        return 0
    return None


class World:
    """The single-process world: rank 0 of 1; every collective is a no-op."""

    rank, size = 0, 1

    @property
    def is_root(self):
        return self.rank == 0

    def allreduce_sum(self, buf):
        """Sum ``buf`` (a contiguous float array) over ranks, in place."""
        return buf

    def agree(self, error):
        """Every rank passes its setup error message (or None); all get back the combined
        message when any rank failed, so all stop together instead of some waiting forever
        in the first collective."""
        return error

    def abort(self, message):
        raise GradtapeError(message)


class MpiWorld(World):
    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def allreduce_sum(self, buf):
        from mpi4py import MPI

        if not (isinstance(buf, np.ndarray) and buf.flags.c_contiguous):
            raise ValueError("allreduce_sum: needs one contiguous array")
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return buf

    def agree(self, error):
        # raw bytes, not mpi4py's pickled objects: lengths first, then padded messages
        from mpi4py import MPI

        mine = (error or "").encode("utf-8")[:4000]
        width = np.array([len(mine)], np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, width, op=MPI.MAX)
        if width[0] == 0:
            return None
        send = np.zeros(int(width[0]), np.uint8)
        send[:len(mine)] = np.frombuffer(mine, np.uint8)
        every = np.zeros((self.size, int(width[0])), np.uint8)
        self.comm.Allgather(send, every)
        msgs = [bytes(row).rstrip(b"\0").decode("utf-8", "replace") for row in every]
        failed = [(r, m) for r, m in enumerate(msgs) if m]
        if len({m for _, m in failed}) == 1 and len(failed) == self.size:
            return failed[0][1]  # the same mistake everywhere: say it once
        return "; ".join(f"rank {r}: {m}" for r, m in failed)

    def abort(self, message):
        """Stop every rank now: a rank that fails alone inside the training loop would
        leave the others blocked in the next Allreduce."""
        print(f"gradtape (rank {self.rank} of {self.size}): error: {message}; stopping all "
              "ranks", file=sys.stderr, flush=True)
        self.comm.Abort(1)


@functools.lru_cache(maxsize=None)
def world() -> World:
    """This process's World (cached: MPI is initialised once per process)."""
    size = launched_size()
    if size is None or size == 1:
        return World()
    try:
        from mpi4py import MPI
    except ImportError:
        raise GradtapeError(
            "launched under mpiexec but mpi4py is not installed in this environment; "
            "install it with: pip install 'gradtape[mpi]'") from None
    comm = MPI.COMM_WORLD
    return MpiWorld(comm) if comm.Get_size() > 1 else World()


class RankStopped(GradtapeError):
    """A rank stops because of an error that another rank reports: the command exits
    non-zero without printing it again (``quiet``)."""

    quiet = True


def _agreed(world, message):
    """The exception every rank raises for an error all of them know about: rank 0 says it,
    the others stop quietly."""
    err = GradtapeError(message) if world.is_root else RankStopped(message)
    err.agreed = True
    return err


class Together:
    """Keeps ranks from waiting forever on one that failed.

    Setup (loading, checks) may fail on some ranks only (a file missing on one machine):
    ``sync()`` after setup, or the exit of the ``with`` block on a failing rank, meets the
    others in one ``agree`` collective, and every rank stops with the same message.  After
    ``sync()`` (inside the training loop) an error on one rank aborts the whole job, since
    the others are already blocked in the next Allreduce; errors every rank sees alike
    (``everywhere``) stop all ranks cleanly.  A no-op with one process."""

    def __init__(self, world):
        self.world, self.synced = world, False

    def sync(self):
        self.synced = True
        message = self.world.agree(None)
        if message:
            raise _agreed(self.world, message)

    def everywhere(self, message):
        """The exception to raise for an error that every rank detects at the same point."""
        return _agreed(self.world, message) if self.world.size > 1 else GradtapeError(message)

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if self.world.size == 1 or exc is None or getattr(exc, "agreed", False) \
                or not isinstance(exc, Exception):
            return False  # KeyboardInterrupt: every rank got the signal or the agreed stop
        text = str(exc) if isinstance(exc, GradtapeError) else f"{kind.__name__}: {exc}"
        if self.synced:
            self.world.abort(text)
            return False
        self.synced = True
        message = self.world.agree(text)
        if isinstance(exc, GradtapeError):
            raise _agreed(self.world, message) from None
        return False  # a bug: its traceback shows on this rank; the others stop quietly
