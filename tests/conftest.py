import os, pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Importing specnb loads Debian's OpenBLAS into this process before MLX (the Linux mlx[cpu] wheel's reference BLAS is ~30x slower
# for fp32 matmul): see nbs/00c_blas.ipynb.
from specnb.blas import OPENBLAS, openblas_env, openblas_relaunch

def pytest_configure(config):
    "Restart pytest with OpenBLAS preloaded only where importing specnb could not load it (a plugin imported MLX first)."
    openblas_relaunch()   # a no-op after the in-process load; SPECNB_NO_OPENBLAS=1 turns both off

def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run cells and tests flagged slow")

def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"): return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords: item.add_marker(skip)

@pytest.fixture(scope="session")
def fast_env():
    "The environment for child processes: OpenBLAS preloaded (with this CPU's kernels) where the machine has it, since notebooks import MLX before specnb."
    return openblas_env() if OPENBLAS.exists() else dict(os.environ)
