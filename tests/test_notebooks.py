"Run every notebook through nbdev's test runner, one pytest test each, so CI ends with one pytest summary."
import subprocess, sys, pytest
from nbdev.doclinks import nbglob
from conftest import ROOT

NOTEBOOKS = sorted(nbglob(ROOT/"nbs", as_path=True))

def test_notebooks_found():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS

@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[str(p.relative_to(ROOT/"nbs")) for p in NOTEBOOKS])
def test_notebook(nb, fast_env, request):
    flags = "slow" if request.config.getoption("--slow") else ""
    cmd = ["nbdev-test", str(nb), "--n-workers", "0", "--flags", flags]
    r = subprocess.run(cmd, cwd=ROOT, env=fast_env, capture_output=True, text=True)
    assert r.returncode == 0, f"{nb.name} failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
