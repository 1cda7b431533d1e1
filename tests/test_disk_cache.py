"""The prompt cache on disk (issue #47) through a real `specnb serve`: killed with SIGKILL in the middle of a write,
then started again on the same folder — the whole entry is reused with the text of a fresh run, the unfinished one never
served (and its temporary file gone), a torn file and a foreign one skipped with one log line each. The write is stopped
at a known point (`SPECNB_PROMPT_CACHE_PAUSE`: the N-th write waits between its sync and its rename), so the kill
lands there every time. The library-level gates (every cache kind, restarts of the engine, concurrent writes) are in
nbs/08ec_disk_cache.ipynb."""

import os, signal, time
import httpx, pytest
from specnb.cli import refusal
from specnb.serve.disk_cache import PAUSE_ENV
from specnb.serve.harness import serve_process

FIRST = "def read_config(path):\n    with open(path) as f:\n"
OTHER = "class Node:\n    def __init__(self, value):\n"


def complete(url: str, prompt: str) -> tuple:
    "A greedy completion's text and how many of its prompt tokens the prompt cache held."
    body = {"model": "specnb-bundled", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    j = r.json()
    return j["choices"][0]["text"], j["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_for(what, timeout: float = 60):
    t0 = time.monotonic()
    while not what():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


def entries(folder) -> list:
    return sorted(folder.glob("[0-9a-f]*.safetensors"))


def test_sigkill_mid_write_then_restart(tmp_path):
    folder = tmp_path / "prompt-cache"
    args = ("--prompt-cache-dir", str(folder), "--max-batch-size", "1")
    with serve_process(*args, env={PAUSE_ENV: "2"}) as s:
        first, cached = complete(s.url, FIRST)
        assert cached == 0
        wait_for(lambda: len(entries(folder)) == 1)  # write 1: whole, in place
        (good,) = entries(folder)
        other, _ = complete(s.url, OTHER)  # write 2 stops before its rename …
        wait_for(lambda: "stopped before its rename" in s.output())
        assert len(list(folder.glob(".tmp-*.safetensors"))) == 1 and entries(folder) == [good]
        s.proc.send_signal(signal.SIGKILL)  # … and the server is killed there
        s.proc.wait()
    torn = folder / ("0" * 64 + ".safetensors")
    torn.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # a file cut short, under a name like ours
    (folder / "notes.safetensors").write_bytes(os.urandom(2048))  # not a prompt-cache file
    with serve_process(*args) as s:
        again, cached = complete(s.url, FIRST)
        assert (again, cached > 0) == (first, True)  # from disk, with the fresh run's text
        again_other, cached_other = complete(s.url, OTHER)
        assert (again_other, cached_other) == (other, 0)  # its entry never landed: read afresh
        lines = [line for line in s.output().splitlines() if "prompt cache:" in line]
    assert sum("is torn" in line for line in lines) == 1 and sum("notes.safetensors" in line for line in lines) == 1
    assert len(lines) == 2, lines
    assert not torn.exists() and (folder / "notes.safetensors").exists()
    assert not list(folder.glob(".tmp-*")), "the killed server's unfinished write was left behind"


@pytest.mark.parametrize(
    "args, says",
    [
        (["--prompt-cache-dir", "{tmp}/c", "--prompt-cache-size", "0"], "--prompt-cache-size 0 turns the cache off"),
        (["--prompt-cache-dir", "{tmp}/file/c"], "cannot make that folder"),
        (["--prompt-cache-dir", "{tmp}/c", "--prompt-cache-disk-bytes", "lots"], "--prompt-cache-disk-bytes must be"),
    ],
)
def test_bad_prompt_cache_dir_is_refused(tmp_path, args, says):
    (tmp_path / "file").write_text("a file, not a folder")
    status, err = refusal(["serve", "--port", "0", *(a.format(tmp=tmp_path) for a in args)])
    assert status == 2 and says in err, err[-2000:]
