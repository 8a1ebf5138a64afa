"""Fetch ahead: copy the shards a rank reads next into the node's cache before its workers need them.

Remote shards (http(s), s3, `pipe:`, `.tar.gz`) are copied whole into `data.cache_dir` by the first
process that needs one (cache.py). Without fetching ahead, the step that first touches a
shard waits for its download. A `FetchAhead` process per rank (started from the rank's fork server
when its train stream starts) walks the rank's coming steps through the real order, and copies
their shards in the order they will first be read, up to the rank's share of the cache
(`data.cache_limit_gb` / ranks per node), touching those already there so that the cache's LRU
eviction keeps them. The rank's loader tells it where it is (`advance(step)`); it starts over
from there when the rank moves on. It and the rank's readers pass the stream's `budget_key` to local_copy:
one data.retry_time_s budget per shard between them, not one each.

It is a process, not a thread: cache.hold_copy holds a `flock` while it copies, and a DataLoader
worker forked from a process while one of its threads held such a lock would hold it forever.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np

from pipeline.remote import Expected, RetryPolicy
from pipeline.signals import exit_with, worker_context

from .cache import local_copy, needs_copy
from .order import SlicedOrder

WAKE_S = 0.2  # how often the fetcher looks at where the rank is
CHUNK_STEPS = 8  # steps whose shards are computed at once


def upcoming_shards(order: SlicedOrder, rank: int, world_size: int, step: int, steps: int) -> np.ndarray:
    """Shard numbers rank `rank` reads in steps [step, step + steps), in the order of first need."""
    per_rank = order.global_batch // world_size
    positions = ((np.arange(step, step + steps, dtype=np.int64)[:, None] * order.global_batch
                  + rank * per_rank + np.arange(per_rank, dtype=np.int64)[None, :]).ravel())
    shards = order.shard_of(order.sample_ids(positions))
    unique, first = np.unique(shards, return_index=True)
    return unique[np.argsort(first, kind="stable")]


def plan(order: SlicedOrder, shard_bytes: list[int], rank: int, world_size: int, step: int, budget: int
         ) -> list[int]:
    """The shards to hold, from `step` on, in the order of first need, until their bytes reach `budget`
    or one pass of the rank's largest partition slice is covered."""
    horizon = step + order.steps_per_pass()
    out: list[int] = []
    seen: set[int] = set()
    total = 0
    for s in range(step, horizon, CHUNK_STEPS):
        for shard in upcoming_shards(order, rank, world_size, s, CHUNK_STEPS).tolist():
            if shard in seen:
                continue
            if total + shard_bytes[shard] > budget:
                return out
            seen.add(shard)
            total += shard_bytes[shard]
            out.append(shard)
    return out


def _loop(order: SlicedOrder, shards: list[str], shard_bytes: list[int], rank: int, world_size: int,
          cache_dir: str | None, limit: int, budget: int, step: Any, stop: Any, ready: Any, rank_pid: int,
          expected: dict[str, Expected], policy: RetryPolicy | None, budget_key: str | None) -> None:
    # Started by the rank's fork server with SIGTERM/SIGUSR1 blocked. This helper must end on terminate()
    # (multiprocessing ends daemonic children with SIGTERM at the rank's exit) and leave preemption and
    # Ctrl-C to the rank.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    exit_with(rank_pid)  # its parent is the fork server: nothing else ends it when the rank dies
    ready.set()
    while not stop.is_set():
        at = step.value
        for s in plan(order, shard_bytes, rank, world_size, at, budget):
            if stop.is_set() or step.value > at + CHUNK_STEPS:
                break  # the rank moved on: plan again from where it is
            if needs_copy(shards[s]):
                try:
                    # fetched (retried, verified), or touched if already there
                    local_copy(shards[s], cache_dir, limit, expected.get(shards[s]), policy, budget_key)
                except Exception:  # noqa: BLE001 - the reader meets the same error and counts it
                    # (a StorageError at once: the budget_key's record says the budget is spent)
                    pass
        stop.wait(WAKE_S)


class FetchAhead:
    """The fetcher of one rank; `advance(step)` after each step, `stop()` at the end."""

    def __init__(self, order: SlicedOrder, shards: list[str], shard_bytes: list[int | None], rank: int,
                 world_size: int, cache_dir: str | None, limit: int, budget: int,
                 expected: dict[str, Expected] | None = None, policy: RetryPolicy | None = None,
                 budget_key: str | None = None):
        known = [b for b in shard_bytes if b]
        sizes = [b or (max(known) if known else 1 << 30) for b in shard_bytes]
        ctx = worker_context()  # not a fork of the rank (see worker_context)
        self._step = ctx.Value("q", 0, lock=False)
        self._stop = ctx.Event()
        self.ready = ctx.Event()  # set once the process has its own signal dispositions
        self.process = ctx.Process(target=_loop, daemon=True, name=f"fetch-ahead-rank{rank}",
                                   args=(order, shards, sizes, rank, world_size, cache_dir, limit, budget,
                                         self._step, self._stop, self.ready, os.getpid(), expected or {}, policy,
                                         budget_key))
        self.process.start()

    def advance(self, step: int) -> None:
        self._step.value = step

    def stop(self) -> None:
        self._stop.set()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
