"Run every notebook through nbdev's test runner, one pytest test each, so CI ends with one pytest summary."
import subprocess, sys, pytest
from nbdev.doclinks import nbglob
from conftest import ROOT, RING

NOTEBOOKS = sorted(nbglob(ROOT/"nbs", as_path=True))
# notebooks that start `mlx.launch` ring jobs: one worker runs them, one at a time (conftest.py)
RING_NOTEBOOKS = {"07a_cli", "07f_distributed", "08a_harness", "08b_serve_distributed", "09_bench", "index"}

def param(nb):
    marks = [pytest.mark.xdist_group(RING)] if nb.stem in RING_NOTEBOOKS else []
    return pytest.param(nb, marks=marks, id=str(nb.relative_to(ROOT/"nbs")))

def test_notebooks_found():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS

def test_ring_notebooks_named():
    "The list above names notebooks that exist and every notebook that starts a ring job."
    launching = {nb.stem for nb in NOTEBOOKS if "ranks=" in nb.read_text() or "mlx.launch" in nb.read_text()}
    assert launching == RING_NOTEBOOKS, (launching ^ RING_NOTEBOOKS)

@pytest.mark.parametrize("nb", [param(nb) for nb in NOTEBOOKS])
def test_notebook(nb, fast_env, request):
    flags = "slow" if request.config.getoption("--slow") else ""
    cmd = ["nbdev-test", str(nb), "--n-workers", "0", "--flags", flags]
    r = subprocess.run(cmd, cwd=ROOT, env=fast_env, capture_output=True, text=True)
    assert r.returncode == 0, f"{nb.name} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
