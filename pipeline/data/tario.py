"""Reading samples out of WebDataset tar shards, with an explicit position per sample.

A sample is the run of consecutive tar members sharing a key (`000123.jpg`, `000123.cls`),
as in webdataset (`webdataset.tariterators.base_plus_ext`). Each raw sample carries where it
starts and ends in the file, so a reader can later seek straight back to it (local files) or
skip to it member by member without decoding anything (pipes, URLs opened with
`webdataset.gopen`).

Nothing here decodes images: `decode_image` and `parse_label` are called by the loader on the
samples it keeps, and raise `SampleError(kind)` so that bad samples are counted by kind.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field

from PIL import Image
from webdataset.tariterators import base_plus_ext

from .info import is_remote

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "tif", "tiff")

# Kinds of bad data, counted separately (`bad_counts()`).
CORRUPT_IMAGE = "corrupt_image"
MISSING_IMAGE = "missing_image"
MISSING_LABEL = "missing_label"
BAD_LABEL = "bad_label"
TRUNCATED_TAR = "truncated_tar"
UNREADABLE_SHARD = "unreadable_shard"
DUPLICATE_MEMBER = "duplicate_member"
BAD_KINDS = (CORRUPT_IMAGE, MISSING_IMAGE, MISSING_LABEL, BAD_LABEL, DUPLICATE_MEMBER, TRUNCATED_TAR, UNREADABLE_SHARD)


class SampleError(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class ShardError(Exception):
    """The shard could not be opened (kind unreadable_shard) or ended early (truncated_tar)."""

    def __init__(self, kind: str, shard: str, detail: str):
        super().__init__(f"{kind} in '{shard}': {detail}")
        self.kind = kind
        self.shard = shard


@dataclass
class RawSample:
    key: str
    index: int
    """Position of the sample in its shard (0-based)."""
    start: int
    """Byte offset of its first tar header."""
    end: int
    """Byte offset just past its last member (where the next sample's header may start)."""
    members: dict[str, bytes] = field(default_factory=dict)


def _round_up(n: int) -> int:
    return (n + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE * tarfile.BLOCKSIZE


def _open(shard: str, offset: int) -> tuple[io.IOBase, int]:
    """Open at byte `offset` if the file can seek; returns (stream, offset actually reached)."""
    if is_remote(shard):
        from webdataset import gopen  # the function: pipes, http(s), s3 via 'pipe:aws s3 cp ...'
        return gopen(shard, "rb"), 0
    f = open(shard, "rb", buffering=1 << 20)  # noqa: SIM115 (closed by the caller)
    if offset:
        f.seek(offset)
    return f, offset


def iter_raw_samples(shard: str, index: int = 0, offset: int = 0) -> Iterator[RawSample]:
    """Samples of `shard` from position (`index`, byte `offset`) on; (0, 0) is the beginning.

    Raises ShardError(unreadable_shard) if nothing can be read, ShardError(truncated_tar) if the
    archive breaks off (the samples before the break are yielded first).
    """
    try:
        stream, base = _open(shard, offset)
    except (OSError, ValueError) as e:  # ValueError: webdataset refusing a URL
        raise ShardError(UNREADABLE_SHARD, shard, str(e)) from None
    # Seeked: numbering goes on from `index`. Not seekable (or no offset): skip `index` samples.
    start_index, skip = (index, 0) if base else (0, index)
    try:
        yield from _samples(stream, shard, base, start_index, skip)
    finally:
        try:
            stream.close()
        except Exception:  # a pipe's non-zero exit: what it did deliver was read; a short count is
            pass           # reported as truncated_tar by the caller


def _samples(stream: io.IOBase, shard: str, base: int, index: int, skip: int) -> Iterator[RawSample]:
    try:
        tar = tarfile.open(fileobj=stream, mode="r|*")
    except (tarfile.TarError, OSError, EOFError) as e:
        if base:  # seeked to the end of the archive: nothing left
            return
        raise ShardError(UNREADABLE_SHARD, shard, f"not a tar archive ({e})") from None
    current: RawSample | None = None
    members_read = 0
    try:
        for info in tar:
            members_read += 1
            tar.members = []  # a streaming TarFile keeps every header otherwise
            if not info.isreg():
                continue
            key, ext = base_plus_ext(info.name)
            if key is None or os.path.basename(key).startswith("__"):
                continue
            ext = ext.lower()
            start = base + info.offset
            end = base + info.offset_data + _round_up(info.size)
            if current is not None and current.key != key:
                if skip:
                    skip -= 1
                else:
                    yield current
                index += 1
                current = None
            if current is None:
                current = RawSample(key, index, start, end)
            if skip:  # fast-forward: do not even copy the member's bytes
                current.end = end
                continue
            fobj = tar.extractfile(info)
            current.members[ext] = fobj.read() if fobj is not None else b""
            current.end = end
        if current is not None and not skip:
            yield current
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        if members_read == 0 and base == 0:
            raise ShardError(UNREADABLE_SHARD, shard, f"not a tar archive ({e})") from None
        raise ShardError(TRUNCATED_TAR, shard, str(e)) from None


def image_member(sample: RawSample) -> tuple[str, bytes]:
    for ext in IMAGE_EXTS:
        if ext in sample.members:
            return ext, sample.members[ext]
    raise SampleError(MISSING_IMAGE, f"sample '{sample.key}' has no image member ({', '.join(sample.members)})")


def decode_image(data: bytes) -> Image.Image:
    """Fully decoded RGB image; a truncated or corrupt file raises SampleError(corrupt_image)."""
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB") if img.mode != "RGB" else img
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError, DecompressionBombError)
        raise SampleError(CORRUPT_IMAGE, str(e)) from None


def parse_label(sample: RawSample, label_key: str, num_classes: int | None = None) -> int:
    """The integer label at `label_key`: a member ('cls', 'txt') or 'json' / 'json:FIELD'."""
    ext, _, json_field = label_key.partition(":")
    if ext == "json" and not json_field:
        json_field = "label"
    raw = sample.members.get(ext)
    if raw is None:
        raise SampleError(MISSING_LABEL, f"sample '{sample.key}' has no '.{ext}' member")
    if json_field:
        try:
            value = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SampleError(BAD_LABEL, f"sample '{sample.key}': .json is not valid JSON ({e})") from None
        for part in json_field.split("."):
            if not isinstance(value, dict) or part not in value:
                raise SampleError(MISSING_LABEL, f"sample '{sample.key}': .json has no field '{json_field}'")
            value = value[part]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SampleError(BAD_LABEL, f"sample '{sample.key}': label {value!r} is not an integer")
        text = str(value)
    else:
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise SampleError(BAD_LABEL, f"sample '{sample.key}': label is not text") from None
    try:
        label = int(text)
    except ValueError:
        raise SampleError(BAD_LABEL, f"sample '{sample.key}': label {text[:40]!r} is not an integer") from None
    if label < 0 or (num_classes is not None and label >= num_classes):
        raise SampleError(BAD_LABEL, f"sample '{sample.key}': label {label} outside [0, {num_classes})")
    return label
