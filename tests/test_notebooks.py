"""Run every notebook through nbdev's test runner, one pytest test each, so CI ends with one pytest summary.

Each notebook runs in a process of its own, as `nbdev-test NOTEBOOK --n-workers 0` would run it, forked from a runner
that has already imported what every notebook imports (`nbzygote.py`): a fresh `nbdev-test` process spent ~5 s of each
notebook on them."""

import json, subprocess, sys, pytest
from pathlib import Path
from nbdev.doclinks import nbglob
from conftest import ROOT, RING

NOTEBOOKS = sorted(nbglob(ROOT / "nbs", as_path=True))
# notebooks that start `mlx.launch` ring jobs: one worker runs them, one at a time (conftest.py)
RING_NOTEBOOKS = {"07a_cli", "07f_distributed", "08a_harness", "08b_serve_distributed", "09_bench", "index"}


def param(nb):
    marks = [pytest.mark.xdist_group(RING)] if nb.stem in RING_NOTEBOOKS else []
    return pytest.param(nb, marks=marks, id=str(nb.relative_to(ROOT / "nbs")))


def test_notebooks_found():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


def test_ring_notebooks_named():
    "The list above names notebooks that exist and every notebook that starts a ring job."
    launching = {nb.stem for nb in NOTEBOOKS if "ranks=" in nb.read_text() or "mlx.launch" in nb.read_text()}
    assert launching == RING_NOTEBOOKS, launching ^ RING_NOTEBOOKS


class Runner:
    "The notebook runner of this pytest worker (`nbzygote.py`), started on first use and again if it ever died."

    def __init__(self, env: dict):
        self.env, self.proc = env, None

    def start(self):
        script = Path(__file__).with_name("nbzygote.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=self.env,
        )

    def run(self, nb: Path, flags: str, log: Path) -> int:
        "The exit status of `nbdev-test NB --n-workers 0 --flags FLAGS`, its output written to `log`."
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(f"{nb}\t{flags}\t{log}\n")
        self.proc.stdin.flush()
        status = self.proc.stdout.readline()
        if not status:
            raise RuntimeError(f"the notebook runner ended with status {self.proc.wait()} while running {nb.name}")
        return int(status)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def runner(fast_env):
    r = Runner(fast_env)
    yield r
    r.close()


@pytest.mark.parametrize("nb", [param(nb) for nb in NOTEBOOKS])
def test_notebook(nb, runner, request, tmp_path):
    flags = "slow" if request.config.getoption("--slow") else ""
    log = tmp_path / "nbdev-test.log"
    status = runner.run(nb, flags, log)
    assert status == 0, f"{nb.name} failed (status {status}):\n{log.read_text()[-12000:]}"


def test_a_failing_notebook_fails(runner, tmp_path):
    """The runner reports a failing cell, and a notebook that kills its own process, as failures with the notebook's
    output."""
    for code, says in (
        ("assert 1 + 1 == 3, 'arithmetic'", "arithmetic"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", ""),
    ):
        nb = tmp_path / "bad.ipynb"
        nb.write_text(
            json.dumps(
                {
                    "cells": [
                        {
                            "cell_type": "code",
                            "execution_count": None,
                            "id": "a1",
                            "metadata": {},
                            "outputs": [],
                            "source": ["print('ran')\n", code],
                        }
                    ],
                    "metadata": {"kernelspec": {"language": "python", "name": "python3"}},
                    "nbformat": 4,
                    "nbformat_minor": 5,
                }
            )
        )
        log = tmp_path / "bad.log"
        status = runner.run(nb, "", log)
        assert status != 0 and says in log.read_text(), (status, log.read_text())
    assert runner.run(ROOT / "nbs" / "99_moved.ipynb", "", log) == 0  # and it runs on after both
