import json, os, pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = Path(__file__).with_name("durations.json")  # seconds each test took in a full run: the longest start first

# Every test runs OpenBLAS with one thread, whatever the machine: the pytest-xdist workers already keep every core busy,
# and a second BLAS thread per process only spins beside them. Measured here (2 cores): two processes speculating on the
# bundled pair at once took 24-26 s with one thread each against 30-34 s with two, and a full `pytest tests --slow` 36.5
# min against 42.5. Pinned rather than left to the machine because how OpenBLAS splits a matmul between threads changes
# its rounding, and the gates compare float32 logprobs across forwards of different shapes to 3e-5 (07's logprobs gate,
# tests/test_turns.py's `CLOSE`). Set before specnb, and with it OpenBLAS, is imported below; children inherit it
# through `fast_env`.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# Every test runs on the same OpenBLAS kernels, Haswell's (AVX2: every x86-64 machine CI draws has it). OpenBLAS
# otherwise picks them by CPU (Cooperlake or SkylakeX where there is AVX-512), and the gates compare float results
# across differently shaped forwards: a batched row against the row alone, seeded samples against seeded samples. A
# sampled token can flip where the draw sits on a rounding boundary — 04e's Kimi-Linear gate did, on a Cooperlake CPU.
# Children inherit it through `fast_env`.
def _has_avx2() -> bool:
    try:
        return any(
            l.startswith("flags") and " avx2 " in f"{l} " for l in Path("/proc/cpuinfo").read_text().splitlines()
        )
    except OSError:
        return False


if _has_avx2():
    os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")
# Importing specnb loads Debian's OpenBLAS into this process before MLX (the Linux mlx[cpu] wheel's reference BLAS is
# ~30x slower for fp32 matmul): see nbs/00c_blas.ipynb.
from specnb.blas import OPENBLAS, openblas_env, openblas_relaunch


def pytest_configure(config):
    """Restart pytest with OpenBLAS preloaded only where importing specnb could not load it (a plugin imported MLX
    first)."""
    openblas_relaunch()  # a no-op after the in-process load; SPECNB_NO_OPENBLAS=1 turns both off


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run cells and tests flagged slow")
    parser.addoption(
        "--store-durations",
        action="store_true",
        help=f"write how long each test took to tests/{DURATIONS.name} (the order tests start in)",
    )


# Tests that start `mlx.launch` ring jobs run on one worker, one at a time (`--dist loadgroup`): ring ranks busy-wait,
# and two jobs at once on a small machine starve each other's ranks past their timeouts.
RING = "ring"


def pytest_collection_modifyitems(config, items):
    """Skip slow tests without `--slow`; start the longest tests first, so no long test is left for the end.

    An `xdist_group` moves as one unit, its tests in the order its file wrote them: they share module-scoped servers,
    and a file is read top to bottom as the order its tests run in."""
    if not config.getoption("--slow"):
        skip = pytest.mark.skip(reason="slow: run with --slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    took = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    units = {}  # a group's name, or a lone test's node id -> its tests, in collection order
    for item in items:
        group = next((m.args[0] for m in item.iter_markers("xdist_group")), None)
        units.setdefault(group or item.nodeid, []).append(item)
    longest_first = sorted(units.values(), key=lambda unit: -sum(took.get(i.nodeid, 1.0) for i in unit))
    items[:] = [item for unit in longest_first for item in unit]


_took, _skipped = {}, set()


def pytest_runtest_logreport(report):
    "Add up each test's setup, call and teardown (on the controller, for every worker's tests)."
    _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration
    if report.skipped:
        _skipped.add(report.nodeid)


def pytest_sessionfinish(session):
    """With `--store-durations`, write what each test took; a test skipped in this run (a slow one without `--slow`)
    keeps the time it took when it last ran, so a run that does include it still starts it in its place."""
    if session.config.getoption("--store-durations") and "PYTEST_XDIST_WORKER" not in os.environ:
        before = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        took = {k: before.get(k, v) if k in _skipped else v for k, v in _took.items()}
        DURATIONS.write_text(json.dumps({k: round(v, 1) for k, v in sorted(took.items())}, indent=0) + "\n")


@pytest.fixture(scope="session")
def fast_env():
    """The environment for child processes: OpenBLAS preloaded (with the kernels pinned above) where the machine has it,
    since notebooks import MLX before specnb."""
    return openblas_env() if OPENBLAS.exists() else dict(os.environ)


def sse_events(url: str, path: str, body: dict, headers: dict | None = None) -> list:
    "`(event name, data)` of a streamed answer from `path` of the server at `url`, read as raw server-sent events."
    import httpx

    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    out = []
    for ev in text.strip().split("\n\n"):
        name, data = ev.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out
