"""Runs notebooks for `test_notebooks.py`, each in a process forked from this one, which has already imported what they
all import.

A notebook's own `nbdev-test` process spends ~5 s before its first cell, most of it in imports every notebook shares
(mlx-lm imports transformers, which imports torch). Forked from here a notebook starts at once, and still runs in a
process of its own: its memory, threads, servers and state end with it, as they did with `nbdev-test` (its exit runs the
same `atexit` handlers).

Nothing here runs an MLX operation: MLX starts its worker threads on first use, and a forked child has only the thread
that forked it, so the first operation must happen in the child. `serve` checks that this process is still
single-threaded.

Protocol, one line each way per notebook: `path<TAB>flags<TAB>log` in (the log gets the notebook's stdout and stderr);
its exit status out."""

import os, sys, threading
from pathlib import Path

TASKS = Path("/proc/self/task")

import specnb  # first, as in a notebook: it loads OpenBLAS before MLX (nbs/00c_blas.ipynb)

# loaded once, for every child
import execnb.shell, fastcore.test, mlx.core, mlx.nn, mlx_lm, nbdev.test, numpy  # noqa: F401
import specnb.executor, specnb.models  # noqa: F401

# and what many import (seconds each, in every notebook that does): mlx-vlm's drafters (~5 s; the published-drafter
# oracles), scipy's statistics (the chi-square gates), hypothesis, the server's stack, jsonschema (~2.4 s: ten notebooks
# validate structured output with it), matplotlib's pyplot (~1.2 s, nine plotting notebooks) and the openai client (~0.9
# s, seven). Not speculators (~3.7 s, three notebooks): importing it starts an OS thread.
import hypothesis, mlx_vlm.speculative.drafters, scipy.stats, specnb.serve  # noqa: F401
import jsonschema, matplotlib.pyplot, openai  # noqa: F401


def run(path: str, flags: str, log: str):
    "In the forked child: `nbdev-test PATH --n-workers 0 --flags FLAGS`, its output into `log`; exits with its status."
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    nbdev.test.nbdev_test(path=path, flags=flags, n_workers=0)  # `sys.exit(1)` when a cell fails, as the command does
    sys.exit(0)


def serve():
    for line in sys.stdin:
        path, flags, log = line.rstrip("\n").split("\t")
        assert threading.active_count() == 1, "a thread started in the zygote: a forked child would not have it"
        # MLX's own threads too (they start with its first operation): every OS thread, where Linux lists them
        assert not TASKS.exists() or len(list(TASKS.iterdir())) == 1, "an OS thread started in the zygote (an MLX op?)"
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            run(path, flags, log)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    serve()
