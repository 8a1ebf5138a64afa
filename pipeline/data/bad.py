"""Bad data: counting what could not be read, by kind, and the stop rule (`data.max_bad_fraction`).

Counters are plain dicts (picklable, JSON-able) so that DataLoader workers can send them back
with each batch and the trainer can sum them across ranks into the checkpoint.
"""

from __future__ import annotations

from typing import Any

MIN_SAMPLES_FOR_BAD_CHECK = 100


def new_counters() -> dict[str, Any]:
    return {"bad": {}, "bad_shards": {}, "causes": {}, "read": 0, "bad_samples": 0, "bytes": 0, "index_bytes": 0,
            "sample_bytes": 0}


def count_bad(counters: dict[str, Any], kind: str, shard: str, cause: str = "") -> None:
    counters["bad"][kind] = counters["bad"].get(kind, 0) + 1
    counters["bad_shards"][shard] = counters["bad_shards"].get(shard, 0) + 1
    counters["bad_samples"] += 1
    if cause and shard not in counters["causes"]:
        counters["causes"][shard] = cause[:300]


def merge_counters(parts: list[dict[str, Any]]) -> dict[str, Any]:
    total = new_counters()
    for c in parts:
        for name in ("bad", "bad_shards"):
            for k, v in c.get(name, {}).items():
                total[name][k] = total[name].get(k, 0) + v
        for k, v in c.get("causes", {}).items():
            total["causes"].setdefault(k, v)
        for name in ("read", "bad_samples", "bytes", "index_bytes", "sample_bytes"):
            total[name] += c.get(name, 0)
    return total


def bad_fraction_message(counters: dict[str, Any], max_fraction: float, who: str) -> str | None:
    """The error text when more than `max_fraction` of the samples read were bad, else None."""
    read, bad = counters["read"], counters["bad_samples"]
    if read < MIN_SAMPLES_FOR_BAD_CHECK or bad <= max_fraction * read:
        return None
    shard, n = max(counters["bad_shards"].items(), key=lambda kv: kv[1])
    kinds = ", ".join(f"{k}={v}" for k, v in sorted(counters["bad"].items()))
    cause = counters["causes"].get(shard)
    return (f"{bad} of {read} samples read by {who} were bad ({100 * bad / read:.1f}% > "
            f"data.max_bad_fraction={max_fraction}); most in shard '{shard}' ({n} bad samples"
            + (f"; {cause}" if cause else "") + f"); by kind: {kinds}")
