"""The pool through the documented CLI: ``prefill-server serve --workers 2`` (a local Ray, two CPU
workers of the embedded model, transfer mode local), driven over HTTP as a user would: requests
spread as the policy says, a long prompt does not hold up short ones routed to the other worker, a
client that hangs up frees its worker's blocks, and a worker SIGKILLed under load fails its requests
clearly (or retries them), comes back within 30 s, and every pool ends empty."""
from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.timeout(900)
EXE = str(pathlib.Path(sys.executable).parent / "prefill-server")
SERVER_LOG: pathlib.Path | None = None  # the pool's log; conftest.py attaches its tail to a failure


def per_worker(url: str, family: str, labels: str = "") -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=60).text
    pat = rf'^{re.escape(family)}\{{{re.escape(labels)}{"," if labels else ""}worker="([^"]+)"\}} (\S+)$'
    return {w: float(v) for w, v in re.findall(pat, text, re.M)}


def workers(url: str) -> list[dict]:
    return httpx.get(url + "/v1/pool", timeout=30).json()["workers"]


def wait_for(cond, timeout_s: float, every_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every_s)
    return False


def blocks_in_use(url: str) -> float:
    return sum(per_worker(url, "prefill_server:kv_blocks_in_use").values())


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    global SERVER_LOG
    log = SERVER_LOG = tmp_path_factory.mktemp("pool") / "serve.log"
    proc = subprocess.Popen([EXE, "serve", "--transfer-mode", "local", "--workers", "2", "--port", "0", "--dtype", "float32",
                             "--kv-cache-gib", "0.5", "--warm-up-tokens", "64", "--max-queue-wait", "300",
                             "--token-budget", "512"],
                            stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"listening on (http://\S+)", line)
        assert m, f"no listening line ({line!r}); log:\n{log.read_text()[-3000:]}"
        url = m.group(1)
        assert wait_for(lambda: len(workers(url)) == 2, 120), workers(url)
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def complete(url: str, prompt, timeout_s: float = 120.0) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=timeout_s)


def test_requests_spread_over_the_workers_and_metrics_say_which(pool):
    before = per_worker(pool, "prefill_server:prefills_total", 'outcome="ok"')
    for i in range(8):  # one at a time: least outstanding tokens ties, the workers take turns
        assert complete(pool, f"Question {i}: what is the capital of France?").status_code == 200
    after = per_worker(pool, "prefill_server:prefills_total", 'outcome="ok"')
    done = {w: after[w] - before.get(w, 0) for w in after}
    assert sum(done.values()) == 8 and len(done) == 2 and min(done.values()) >= 2, done
    info = workers(pool)
    assert len({w["stats"]["pid"] for w in info}) == 2
    assert httpx.get(pool + "/health").json() == {"status": "ok"}


def test_a_cache_salt_goes_to_the_worker_and_a_bad_one_is_refused(pool):
    body = {"prompt": "Tenant question: what is the capital of France?", "max_tokens": 1}
    for _ in range(2):
        r = httpx.post(pool + "/v1/completions", json={**body, "cache_salt": "tenant-a"}, timeout=120)
        assert r.status_code == 200, r.text
    r = httpx.post(pool + "/v1/completions", json={**body, "cache_salt": "a/b"}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_a_long_prompt_does_not_hold_up_short_ones_on_the_other_worker(pool):
    """SmolLM2 has 8,192 positions and this CPU computes a few hundred tokens a second: the long prompt
    is 3,000 tokens (the issue asks 60K of a larger model on a GPU)."""
    long_done: dict[str, float] = {}

    def long_request():
        t0 = time.monotonic()
        r = complete(pool, [1000 + i % 5000 for i in range(3000)], 300)
        assert r.status_code == 200, r.text
        long_done["s"] = time.monotonic() - t0

    t = threading.Thread(target=long_request)
    t.start()
    assert wait_for(lambda: any(w["outstanding_tokens"] >= 2500 for w in workers(pool)), 30, 0.1)
    busy = next(w["worker"] for w in workers(pool) if w["outstanding_tokens"] >= 2500)
    before = per_worker(pool, "prefill_server:prefills_total", 'outcome="ok"')
    short = []
    for i in range(5):
        t0 = time.monotonic()
        assert complete(pool, f"Short question {i}?").status_code == 200
        short.append(time.monotonic() - t0)
    long_running = t.is_alive()
    after = per_worker(pool, "prefill_server:prefills_total", 'outcome="ok"')
    t.join()
    assert after.get(busy, 0) == before.get(busy, 0), "a short prompt went to the busy worker"
    assert long_running, f"the long prompt ended before the short ones ({long_done})"
    assert max(short) < 5.0 and max(short) < long_done["s"] / 3, (short, long_done)


def test_a_client_that_hangs_up_frees_its_workers_blocks(pool):
    with pytest.raises(httpx.ReadTimeout):
        complete(pool, [2000 + i % 3000 for i in range(6000)], timeout_s=3.0)
    assert wait_for(lambda: blocks_in_use(pool) == 0 and all(
        w["stats"].get("running", 1) == 0 and w["stats"].get("waiting", 1) == 0 for w in workers(pool)), 30), \
        workers(pool)
    assert complete(pool, "Still there?").status_code == 200


def under_load(pool: str, fault) -> tuple[list[tuple[int, str, float]], list[float], float]:
    """50 requests, 8 at a time; ``fault()`` once ten have ended. Returns (status, body, seconds) of
    each, when each 200 ended, and when the fault came (monotonic)."""
    results: list[tuple[int, str, float]] = []
    ended_ok: list[float] = []

    def one(i: int):
        t0 = time.monotonic()
        r = complete(pool, [3000 + (i * 7 + j) % 4000 for j in range(32 + 4 * i)], timeout_s=120)
        results.append((r.status_code, r.text, time.monotonic() - t0))
        if r.status_code == 200:
            ended_ok.append(time.monotonic())

    ex = ThreadPoolExecutor(8)
    try:
        futs = [ex.submit(one, i) for i in range(50)]
        assert wait_for(lambda: len(results) >= 10, 300, 0.1)
        fault()
        fault_at = time.monotonic()
        _, hung = concurrent.futures.wait(futs, timeout=240)
        assert not hung, (f"{len(hung)} requests had not ended 240 s after the fault (each waits 120 s at most): "
                          f"ended {[(c, round(s, 1)) for c, _, s in results]}, pool {workers(pool)}")
        for f in futs:
            f.result()
    finally:
        ex.shutdown(wait=False, cancel_futures=True)  # a failure above does not wait for every request
    return results, ended_ok, fault_at


def assert_all_ended_and_the_pool_recovers(pool: str, victim: int, results, ended_ok, fault_at) -> None:
    codes = [c for c, _, _ in results]
    assert len(results) == 50 and set(codes) <= {200, 503}, [(c, t[:200]) for c, t, _ in results if c not in (200, 503)]
    for code, text, _ in results:
        if code == 503:
            assert "worker" in text and "retry" in text, text
    assert max(s for _, _, s in results) < 100
    after = [t for t in ended_ok if t > fault_at]
    assert after and min(after) - fault_at < 30, f"nothing served within 30 s of the fault: {workers(pool)}"
    # Serve replaces the lost worker (its model loads in ~30-60 s on this 2-core box)
    assert wait_for(lambda: len(workers(pool)) == 2 and victim not in {w["stats"].get("pid") for w in workers(pool)},
                    180), workers(pool)
    assert wait_for(lambda: blocks_in_use(pool) == 0, 30), per_worker(pool, "prefill_server:kv_blocks_in_use")


def test_a_worker_killed_under_load(pool):
    """One worker SIGKILLed under load: every request ends (200, or a 503 naming the lost worker) well
    before its deadline, the survivor serves on (a request succeeds within 30 s of the kill), Serve
    replaces the dead worker, and both end with no blocks in use."""
    victim = workers(pool)[0]["stats"]["pid"]
    assert_all_ended_and_the_pool_recovers(pool, victim, *under_load(pool, lambda: os.kill(victim, signal.SIGKILL)))


def test_a_worker_that_hangs_under_load(pool):
    """One worker SIGSTOPped under load (a wedged worker: Ray sees no death, its calls just never
    answer): its requests are run again elsewhere (or end 503) once it has been silent for
    pool.WORKER_SILENT_S, the other serves on, its failed health check gets it replaced, and the pool
    ends empty."""
    victim = workers(pool)[0]["stats"]["pid"]
    try:
        assert_all_ended_and_the_pool_recovers(pool, victim, *under_load(pool, lambda: os.kill(victim, signal.SIGSTOP)))
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass
