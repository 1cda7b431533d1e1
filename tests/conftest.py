import os, pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Debian's OpenBLAS: the Linux mlx[cpu] wheel ships a reference BLAS that is ~30x slower for fp32 matmul.
from specnb.models import OPENBLAS, openblas_env, openblas_relaunch

def pytest_configure(config):
    "Restart pytest once with OpenBLAS preloaded (it must be loaded before MLX): the suite runs several times faster."
    openblas_relaunch()   # the specnb commands' own restart; SPECNB_NO_OPENBLAS=1 turns it off

def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run cells and tests flagged slow")

def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"): return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords: item.add_marker(skip)

@pytest.fixture(scope="session")
def fast_env():
    "The environment for child processes: OpenBLAS preloaded (with this CPU's kernels) where the machine has it."
    return openblas_env() if OPENBLAS.exists() else dict(os.environ)
