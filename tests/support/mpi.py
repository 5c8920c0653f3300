"""MPI for tests: the ``mpiexec`` beside the interpreter (``make test`` installs mpi4py and
the mpich wheel) and the environment its ranks run in (one thread each, no launcher
variables inherited from an outer run)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def _mpiexec():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                         os.environ.get("PATH", "")]))


MPIEXEC = _mpiexec()


def mpi_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    for var in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        env.pop(var, None)
    return env
