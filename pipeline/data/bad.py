"""Bad data: the data errors, counting what could not be read, by kind, and the stop rule
(`data.max_bad_fraction`).

`DataError` is a user's mistake in the data set (a missing file, a dataset.json that disagrees with the
shards); `BadDataError` a data set with too many samples that cannot be read. A remote object that cannot
be had is neither: `pipeline.remote.StorageError` (a network fault is never bad data).

`Counters` travel with each batch from the DataLoader workers (pickled), add up with `+` (per
rank, then across ranks by the trainer), and go into the checkpoint as a plain dict
(`to_state`), without this process's I/O figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

MIN_SAMPLES_FOR_BAD_CHECK = 100
IO_FIELDS = ("bytes", "index_bytes", "sample_bytes")  # what this process read: not part of the run's state


class DataError(ValueError):
    """A user error in the data set (missing or inconsistent files); the message names the file."""


class BadDataError(RuntimeError):
    """Too many corrupt samples: more than `data.max_bad_fraction` of those read; names the worst shard."""


@dataclass
class Counters:
    bad: dict[str, int] = field(default_factory=dict)
    """Bad samples by kind (tario.BAD_KINDS)."""
    bad_shards: dict[str, int] = field(default_factory=dict)
    """Bad samples by shard."""
    causes: dict[str, str] = field(default_factory=dict)
    """The first cause seen per shard (the reader's error, cut to 300 characters)."""
    read: int = 0
    """Samples read (good or bad)."""
    bytes: int = 0
    """Bytes read from shard files (member data and the tar headers between members)."""
    index_bytes: int = 0
    """Bytes read from shard index files."""
    sample_bytes: int = 0
    """Bytes of the members of the samples read."""

    def count_bad(self, kind: str, shard: str, cause: str = "") -> None:
        self.bad[kind] = self.bad.get(kind, 0) + 1
        self.bad_shards[shard] = self.bad_shards.get(shard, 0) + 1
        if cause and shard not in self.causes:
            self.causes[shard] = cause[:300]

    def __add__(self, other: Counters) -> Counters:
        total = Counters()
        for part in (self, other):
            for name in ("bad", "bad_shards"):
                for k, v in getattr(part, name).items():
                    getattr(total, name)[k] = getattr(total, name).get(k, 0) + v
            for k, v in part.causes.items():
                total.causes.setdefault(k, v)
            for name in ("read", *IO_FIELDS):
                setattr(total, name, getattr(total, name) + getattr(part, name))
        return total

    @property
    def bad_samples(self) -> int:
        """Bad samples of every kind (derived: not stored, so it cannot disagree with `bad`)."""
        return sum(self.bad.values())

    def to_state(self) -> dict[str, Any]:
        """For the checkpoint: a plain dict, without this process's I/O figures."""
        return {k: v for k, v in asdict(self).items() if k not in IO_FIELDS}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Counters:
        # Unknown keys are dropped: a checkpoint written before bad_samples was derived still holds it.
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in names})

    def bad_fraction_message(self, max_fraction: float, who: str) -> str | None:
        """The error text when more than `max_fraction` of the samples read were bad, else None."""
        read, bad = self.read, self.bad_samples
        if read < MIN_SAMPLES_FOR_BAD_CHECK or bad <= max_fraction * read:
            return None
        shard, n = max(self.bad_shards.items(), key=lambda kv: kv[1])
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(self.bad.items()))
        cause = self.causes.get(shard)
        return (f"{bad} of {read} samples read by {who} were bad ({100 * bad / read:.1f}% > "
                f"data.max_bad_fraction={max_fraction}); most in shard '{shard}' ({n} bad samples"
                + (f"; {cause}" if cause else "") + f"); by kind: {kinds}")


def merge_counters(parts: list[Counters]) -> Counters:
    """The sum of `parts` (all ranks' counters, for the checkpoint)."""
    return sum(parts, Counters())
