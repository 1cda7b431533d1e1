"""Run every notebook through nbdev's test runner, one pytest test each, so CI ends with one pytest summary.

Each notebook runs in this pytest worker's process (nbdev's `test_nb`, a fresh IPython shell per notebook, in the notebook's
folder) rather than in an `nbdev-test` subprocess of its own: a subprocess paid ~5 s of interpreter and import start-up
(mlx-lm, transformers, torch) for each of the 60-odd notebooks, more than many of them take to run. Notebooks share nothing
but imported modules: none depends on a fresh process's random state (MLX, NumPy and Python seed theirs from the clock),
and the processes they start get the environment a subprocess would have had (`fast_env`: OpenBLAS preloaded)."""
import gc, io, os, signal, sys, unittest.mock
import mlx.core as mx, pytest
from nbdev.config import get_config
from nbdev.doclinks import nbglob
import nbdev.test
from conftest import ROOT, RING

NOTEBOOKS = sorted(nbglob(ROOT/"nbs", as_path=True))
# notebooks that start `mlx.launch` ring jobs: one worker runs them, one at a time (conftest.py)
RING_NOTEBOOKS = {"07a_cli", "07f_distributed", "08a_harness", "08b_serve_distributed", "09_bench", "index"}
CFG = get_config(ROOT/"nbs")

def param(nb):
    marks = [pytest.mark.xdist_group(RING)] if nb.stem in RING_NOTEBOOKS else []
    return pytest.param(nb, marks=marks, id=str(nb.relative_to(ROOT/"nbs")))

def test_notebooks_found():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS

def test_ring_notebooks_named():
    "The list above names notebooks that exist and every notebook that starts a ring job."
    launching = {nb.stem for nb in NOTEBOOKS if "ranks=" in nb.read_text() or "mlx.launch" in nb.read_text()}
    assert launching == RING_NOTEBOOKS, (launching ^ RING_NOTEBOOKS)

def run_notebook(nb, slow:bool, env:dict)->tuple:
    "Run `nb` as `nbdev-test` would (its cells flagged `slow` too when `slow`): (passed, the traceback nbdev printed)."
    skip = CFG.tst_flags.split() if isinstance(CFG.tst_flags, str) else list(CFG.tst_flags)
    err, sigint = io.StringIO(), signal.getsignal(signal.SIGINT)
    try:
        with unittest.mock.patch.dict(os.environ, env), unittest.mock.patch.object(sys, "__stderr__", err):   # nbdev writes tracebacks there
            passed, _ = nbdev.test.test_nb(nb, skip_flags=skip, force_flags=["slow"] if slow else [], basepath=CFG.config_path)
    finally:
        signal.signal(signal.SIGINT, sigint)   # test_nb installs its own Ctrl-C handler
        gc.collect(); mx.clear_cache()         # the notebook's models go with its shell
    return passed, err.getvalue()

@pytest.mark.parametrize("nb", [param(nb) for nb in NOTEBOOKS])
def test_notebook(nb, fast_env, request):
    passed, err = run_notebook(nb, request.config.getoption("--slow"), fast_env)
    assert passed, f"{nb.name} failed:\n{err[-12000:]}"
