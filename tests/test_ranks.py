"""Ranks never outlive their job (#29): `specnb serve --distributed` started by `mlx.launch` as two ring ranks on this
machine. A launcher killed with SIGTERM (a shell `trap`, a supervisor) forwards nothing to its ranks: they must notice
and exit. SIGTERM must end a rank within seconds whatever its peer did — even when its stderr is a pipe nobody reads any
more (an orphan's), and when its main thread waits inside a collective on a peer that hangs."""

import os, shutil, signal, socket, subprocess, sys, time
from contextlib import contextmanager
from pathlib import Path
import httpx, psutil, pytest
from conftest import RING

pytestmark = pytest.mark.xdist_group(RING)  # one ring job at a time, on one worker (conftest.py)

BOUND = 20  # seconds for a rank to exit: slack for a loaded 2-core machine (it takes under 1 s here alone)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gone(p: psutil.Process) -> bool:
    "Has `p` exited? (an orphan's zombie, not yet reaped by init, counts as exited)"
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(procs: list, bound: float = BOUND) -> float:
    "Seconds until every process in `procs` exited; `bound` when some did not."
    t0 = time.monotonic()
    while not all(gone(p) for p in procs) and time.monotonic() - t0 < bound:
        time.sleep(0.1)
    return time.monotonic() - t0


@contextmanager
def job(tmp_path, stderr_gone: bool = False):
    """`specnb serve --distributed` as two ranks of an `mlx.launch` job in a session of its own, answering /health;
    yields (launcher, ranks by rank, its URL, log). `stderr_gone`: each rank's stderr is a pipe whose reader has exited,
    as an orphaned rank's is once its launcher died. Every process is killed after."""
    here = str(Path(sys.executable).parent)  # this environment's commands first
    specnb, launcher = (shutil.which(c, path=here) or shutil.which(c) for c in ("specnb", "mlx.launch"))
    port = _free_port()
    serve = [specnb, "serve", "--distributed", "--port", str(port), "--log-level", "warning"]
    # exec: the rank keeps the launcher as its parent
    rank = ["bash", "-c", 'exec "$@" 2> >(exit 0)', "rank", *serve] if stderr_gone else serve
    log = tmp_path / "job.log"
    # a ring port of its own (two: one per rank), so that jobs started by other tests never collide
    with open(log, "w") as out:
        p = subprocess.Popen(
            [launcher, "--backend", "ring", "-n", "2", "--starting-port", str(_free_port()), "--", *rank],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        t0 = time.monotonic()
        while True:
            assert p.poll() is None, f"the job exited with status {p.returncode}: {log.read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < 180, f"no /health within 180 s: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        ranks = {int(c.environ()["MLX_RANK"]): c for c in psutil.Process(p.pid).children() if "MLX_RANK" in c.environ()}
        assert sorted(ranks) == [0, 1], ranks
        print(f"\njob up after {time.monotonic() - t0:.1f} s")
        yield p, ranks, f"http://127.0.0.1:{port}", log
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher's session: it and both ranks, stopped or not
        except ProcessLookupError:
            pass
        p.wait()


def test_ranks_exit_with_their_launcher(tmp_path):
    "SIGTERM to `mlx.launch` (which forwards nothing): both ranks exit, and the port is free again."
    with job(tmp_path) as (launcher, ranks, url, log):
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(10)
        took = wait_gone(list(ranks.values()))
        alive = [r for r, p in ranks.items() if not gone(p)]
        assert not alive, f"ranks {alive} still running {took:.0f} s after their launcher was stopped with SIGTERM"
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
        print(f"both ranks exited {took:.1f} s after the launcher's SIGTERM")


@pytest.mark.parametrize(
    "hit,victim,stderr_gone",
    [(signal.SIGKILL, 1, True), (signal.SIGSTOP, 0, False)],
    ids=["rank1-killed-stderr-gone", "rank0-stopped"],
)
def test_sigterm_ends_a_rank_whose_peer_is_gone(tmp_path, hit, victim, stderr_gone):
    """One rank killed (or stopped: a hung machine), then SIGTERM to the other: it exits within seconds — rank 0 with a
    stderr nobody reads, rank 1 while its main thread waits in an idle tick's collective on the stopped rank 0."""
    with job(tmp_path, stderr_gone) as (launcher, ranks, url, log):
        other, t0 = ranks[1 - victim], time.monotonic()
        os.kill(ranks[victim].pid, hit)
        wait_gone([other], 1)  # when its rank exited, the launcher sent the other its own SIGTERM
        if not gone(other):
            other.send_signal(signal.SIGTERM)
        wait_gone([other])
        assert gone(other), (
            f"rank {1 - victim} still running {time.monotonic() - t0:.0f} s after SIGTERM (rank {victim} {hit.name}): "
            f"{log.read_text()[-2000:]}"
        )
        if not stderr_gone:  # its one line, as the launcher passed it on
            line = f"specnb: error: rank {1 - victim}: stopped by SIGTERM"
            while line not in log.read_text() and time.monotonic() - t0 < 30:
                time.sleep(0.1)
            assert line in log.read_text(), log.read_text()[-2000:]
        print(f"rank {victim} {hit.name}: rank {1 - victim} gone {time.monotonic() - t0:.1f} s later")
