import os, pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every test runs on the same OpenBLAS kernels, Haswell's (AVX2: every x86-64 machine CI draws has it). OpenBLAS otherwise picks
# them by CPU (Cooperlake or SkylakeX where there is AVX-512), and the gates compare float results across differently shaped
# forwards: a batched row against the row alone, seeded samples against seeded samples. A sampled token can flip where the draw
# sits on a rounding boundary — 04e's Kimi-Linear gate did, on a Cooperlake CPU. Children inherit it through `fast_env`.
def _has_avx2()->bool:
    try: return any(l.startswith("flags") and " avx2 " in f"{l} " for l in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError: return False
if _has_avx2(): os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")
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
    "The environment for child processes: OpenBLAS preloaded (with the kernels pinned above) where the machine has it, since notebooks import MLX before specnb."
    return openblas_env() if OPENBLAS.exists() else dict(os.environ)
