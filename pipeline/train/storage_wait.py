"""What a watchdog knows of storage waits: its own node's, from the beacon, and the other nodes', through the
job's store.

A reader retrying storage within data.retry_time_s moves its node's beacon (`RetryPolicy.waiting`,
pipeline/remote/retry.py): a file in data.cache_dir that every process of that node reaches. A rank on
another node that waits for this one in a collective (the step's all-reduce, an evaluation's gather) has its
own cache folder on its own host: the beacon never reaches it, and its watchdog would end a healthy job as
hung while the store is down for longer than dist.timeout_s.

So every rank's watchdog passes its node's wait on through the job's rendezvous store: the TCPStore at
MASTER_ADDR:MASTER_PORT through which every rank joined the process group (hosted by rank 0, or by
torchrun's agent), over a connection of its own. One key holds the latest wait of any node: how many
seconds it still holds, what is retried, and where. A watchdog whose rank has made no progress for
dist.timeout_s reads it. The store, not the process group: the ranks' main threads may be inside a
collective (that is the case at hand), the watchdog's thread is not, and reading a key needs no peer to
take part. No clocks are compared between hosts: a wait travels as the seconds it still holds, counted on
the reading host from when it first read it (up to a watchdog tick late, a second at most).

A store that cannot be reached (rank 0 gone, a network fault) gives no evidence: the watchdog then decides
on its own node's beacon alone, as it would without this. So does one that does not answer: under
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the store lives in rank 0's process, and a rank 0 stopped (SIGSTOP, a
frozen host) holds a client's call for ever, its timeout notwithstanding (measured with torch 2.11: a check()
still waiting after 100 s with a 5 s timeout; it answers when the process is continued). Every store call
therefore runs on a thread of its own, waited on for STORE_TIMEOUT_S; while one is still out, no other is
made. Without that, the watchdog of rank 0's peer sat in the store and never said the hang.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

KEY = "vit-pipeline/storage-wait"  # one key for the job: the latest wait of any node
STORE_TIMEOUT_S = 5.0  # the longest one store call may hold the watchdog's thread (a store that does not answer)
NO_ANSWER = object()  # StorageWaits._ask: the store gave none


def storage_wait_s(data: Any) -> float:
    """The longest one storage wait can hold a rank (DataConfig): retries for data.retry_time_s, and the last
    attempt's data.read_timeout_s (a beacon is set to when the next attempt will have answered or timed out)."""
    return data.retry_time_s + data.read_timeout_s


def job_store(master_addr: str, master_port: int, timeout_s: float = STORE_TIMEOUT_S) -> Any | None:
    """A client of the job's rendezvous store of its own (the process group's may be busy in the main thread);
    None when it cannot be reached."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(master_addr, master_port, is_master=False, timeout=timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    except Exception:  # torch's DistNetworkError, a timeout: no evidence from other nodes
        return None


class StorageWaits:
    """`wait()`: the storage wait that holds longest, this node's or another's; `share()` on every watchdog
    tick passes this node's on. `store`: `job_store(...)`, or None on one node."""

    def __init__(self, beacon: str | None, store: Any | None = None):
        self.beacon, self.store = beacon, store
        self.host = socket.gethostname()
        self.node = f"{self.host}:{beacon}"  # this node's own key entries: two nodes may share a host name
        self._sent: float | None = None  # the beacon time last passed on
        self._out: threading.Thread | None = None  # a store call that has not answered (its host stopped)
        self._seen = self._read()  # what was there before this watchdog (an earlier start of the job): not news
        self._until, self._what = -math.inf, ""  # the latest other node's wait: monotonic end, what it retries

    @classmethod
    def of_job(cls, beacon: str, world_size: int) -> StorageWaits:
        """For a run's watchdog: the store joins in only with more than one rank (MASTER_ADDR/PORT as
        pipeline.dist exported them)."""
        store = None
        if world_size > 1 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT", "").isdigit():
            store = job_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        return cls(beacon, store)

    def local(self) -> tuple[float, str] | None:
        """(seconds since this node's current wait ends: negative while a reader still retries, what it
        retries) from the beacon; None without one."""
        try:
            with open(self.beacon or "", encoding="utf-8", errors="replace") as f:
                return time.time() - os.fstat(f.fileno()).st_mtime, f.read(500).strip()
        except OSError:
            return None

    def share(self) -> None:
        """Pass this node's wait on to the other nodes when a reader has moved the beacon (each retry)."""
        if self.store is None:
            return
        try:
            until = os.stat(self.beacon or "").st_mtime
        except OSError:
            return
        held = until - time.time()
        if until == self._sent or held <= 0:  # passed on already, or over
            return
        local = self.local()
        value = json.dumps({"from": f"{self.node}:{until}", "node": self.host, "for_s": held,
                            "what": local[1] if local else ""})
        if self._ask(lambda store: store.set(KEY, value)) is not NO_ANSWER:
            self._sent = until  # else the store is gone or silent (rank 0 ended or stopped): tried at the next retry

    def remote(self) -> tuple[float, str] | None:
        """(seconds since the latest other node's wait ends, what it retries, where); None if none was seen."""
        value = self._read()
        if value is not None and value != self._seen:
            self._seen = value
            try:
                sent = json.loads(value)
                if not str(sent["from"]).startswith(self.node + ":"):  # not this node's own, read back
                    self._until = time.monotonic() + float(sent["for_s"])
                    self._what = f"{sent['what']}, on node {sent['node']}"
            except (ValueError, KeyError, TypeError):
                pass  # not ours to read
        return (time.monotonic() - self._until, self._what) if self._what else None

    def wait(self) -> tuple[float, str] | None:
        """The wait that holds longest (the smallest time since its end), this node's or another's; None."""
        waits = [w for w in (self.local(), self.remote()) if w is not None]
        return min(waits, key=lambda w: w[0]) if waits else None

    def _read(self) -> str | None:
        value = self._ask(lambda store: store.get(KEY).decode() if store.check([KEY]) else None)
        return None if value is NO_ANSWER else value  # a store gone or silent: no evidence

    def _ask(self, call: Callable[[Any], Any]) -> Any:
        """call(store) on a thread of its own, waited on for STORE_TIMEOUT_S: its value, or NO_ANSWER (no store, an
        error, no answer in time, or an earlier call still out)."""
        if self.store is None or (self._out is not None and self._out.is_alive()):
            return NO_ANSWER
        answer: list[Any] = []

        def ask() -> None:
            try:
                answer.append(call(self.store))
            except Exception:  # torch's DistNetworkError, DistStoreError: the store is gone
                pass

        thread = threading.Thread(target=ask, name="job-store", daemon=True)  # a daemon: never holds the exit
        thread.start()
        thread.join(STORE_TIMEOUT_S)
        if thread.is_alive():
            self._out = thread
            return NO_ANSWER
        return answer[0] if answer else NO_ANSWER
