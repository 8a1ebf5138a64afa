"""One retry budget per shard for a rank: its fetch-ahead process and its readers do not each spend
data.retry_time_s on the same dead shard (cache.py's budget record)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.data.cache import BUDGET_SUFFIX, cache_name, local_copy
from pipeline.remote.storage import RetryPolicy, StorageError

BUDGET_S = 2.0
# A budget spent takes at least a third of BUDGET_S, whatever the machine: the storage layer gives up when the
# next backoff would pass the deadline, and a backoff (doubling, jittered to half to all of it) is at most
# twice the waits before it, so the time left then is under twice the time spent. Measured 0.98 to 2.0 s
# on the 2-core machine under load (the half this test asked before failed once, at 0.98 s).
SPENT_AT_LEAST_S = BUDGET_S / 4
POLICY = RetryPolicy(attempts=1000, total_s=BUDGET_S, backoff_s=0.05, timeout_s=5.0)


@pytest.fixture
def dead_server() -> Iterator[tuple[str, list[int]]]:
    """An HTTP server that answers 503 to everything; yields its base URL and the count of requests."""
    hits = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits[0] += 1
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hits
    server.shutdown()
    server.server_close()


def _timed_copy(url: str, cache: Path, key: str | None) -> tuple[float, str]:
    t0 = time.monotonic()
    with pytest.raises(StorageError) as e:
        local_copy(url, str(cache), 1 << 30, None, POLICY, key)
    return time.monotonic() - t0, str(e.value)


def test_fetch_ahead_and_reader_share_one_budget_per_shard(dead_server: tuple[str, list[int]], tmp_path: Path,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    base, hits = dead_server
    url = f"{base}/train-000000.tar"
    # the fetch-ahead process spends the budget...
    first_s, first = _timed_copy(url, tmp_path, "rank0-run1")
    assert first_s >= SPENT_AT_LEAST_S and "HTTP 503" in first
    requests = hits[0]
    # ...and the reader of the same rank, which waited on the shard's lock, fails at once with that line,
    # without another request (before: a second full budget, up to 2x data.retry_time_s). "At once": less
    # than any budget of its own could take; measured 0.01 s on the 2-core machine under load.
    second_s, second = _timed_copy(url, tmp_path, "rank0-run1")
    assert second_s < SPENT_AT_LEAST_S
    assert first in second and "already spent" in second
    assert hits[0] == requests
    # a new run (another key) on the same node gets a budget of its own
    third_s, _ = _timed_copy(url, tmp_path, "rank0-run2")
    assert third_s >= SPENT_AT_LEAST_S and hits[0] > requests
    capfd.readouterr()


def test_a_budget_half_spent_leaves_the_next_caller_only_the_rest(dead_server: tuple[str, list[int]],
                                                                  tmp_path: Path) -> None:
    base, _ = dead_server
    url = f"{base}/train-000001.tar"
    # a fetch that started 1.9 s ago (the record a fetch-ahead process killed mid-fetch would leave): the
    # next caller's retries are handed that record's deadline, not a budget of its own...
    import pipeline.data.cache as cache

    until = time.time() + BUDGET_S - 1.9
    record = tmp_path / (cache_name(url) + BUDGET_SUFFIX)
    record.write_text(f'{{"key": "k", "until": {until}}}')
    deadlines: list[float | None] = []
    real = cache._fetch

    def fetch(shard: str, out: Path, expected: object, policy: object, until: float | None = None) -> None:
        deadlines.append(until)
        real(shard, out, expected, policy, until)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache, "_fetch", fetch)
        spent, _ = _timed_copy(url, tmp_path, "k")
    assert deadlines == [until]
    # ...and stop there: the 0.1 s left (or less: the last backoff that fits) plus a request, under what a
    # budget of its own takes at least (measured: 0.11 to 0.28 s for the test on the 2-core machine under load)
    assert spent < SPENT_AT_LEAST_S


def test_a_fetched_shard_clears_its_budget_record(tmp_path: Path) -> None:
    import pipeline.data.cache as cache

    url = "http://127.0.0.1:1/ok.tar"
    record = tmp_path / (cache_name(url) + BUDGET_SUFFIX)

    def fake_fetch(shard: str, out: Path, expected: object, policy: object, until: float | None = None) -> None:
        assert until is not None and record.exists()  # the budget is on record while the fetch runs
        import io
        import tarfile

        with tarfile.open(out, "w") as tar:
            data = b"x"
            info = tarfile.TarInfo("a.cls")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

    mp = pytest.MonkeyPatch()
    mp.setattr(cache, "_fetch", fake_fetch)
    try:
        path = local_copy(url, str(tmp_path), 1 << 30, None, POLICY, "k")
    finally:
        mp.undo()
    assert Path(path).exists() and not record.exists()
