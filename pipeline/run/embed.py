"""launch/embed.py: every sample's features written as Parquet, keyed by the sample's key.

Output (a local folder or an s3:// prefix):

    OUT/_embeddings.json               what was embedded (source, checkpoint, data, splits, dims), rows when complete
    OUT/<split>/part-00000.parquet     one part per input shard: key (<split>/<the sample's key>, unique), split,
                                       source (the file make_shards made the sample from; null for shards without
                                       KEY.src), label (null without), cls (float32[D]), mean_patch (float32[D]),
                                       patch_tokens (float32[N*D], on request)

`pandas.read_parquet(OUT)` reads the folder whole: Arrow's dataset discovery passes over names that start with
'_' or '.', the manifest's among them (an output of version 1, its manifest `embeddings.json`, is refused as
another run's, not written into).

Parquet, because any data tool reads it without this project (pandas, polars, DuckDB, Spark, Hugging Face
datasets, pyarrow), columnar (read the keys or one column alone), typed (fixed-size float32 lists become
one (rows, D) array with no parsing) and compressed per column; WebDataset .npy members would need a tar
reader and one file per sample per column. One part per input shard: every sample once whatever the number
of ranks (rank r writes parts r, r + world, ...; no collective but the end), and a part is written whole
under a temporary name and renamed (a bucket: uploaded, visible once complete), so a run killed halfway
and started again skips the parts that exist and writes the same bytes for the rest (the same batches
through the same model). Samples whose image cannot be decoded are left out and counted.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline import atomic
from pipeline.config import DataConfig
from pipeline.data import dataset_info_of, tario
from pipeline.data.info import expected_of
from pipeline.data.pixels import for_model
from pipeline.data.reader import Indexes
from pipeline.data.transforms import BatchNormalizer, eval_transform
from pipeline.dist import DistEnv
from pipeline.eval.features import embedding
from pipeline.remote import RetryPolicy, read_bytes, s3
from pipeline.run.backbone import Backbone
from pipeline.signals import WorkerInit, reap_workers_at_exit, worker_context

MANIFEST = "_embeddings.json"  # '_': not a part to pandas/pyarrow/polars reading the folder
OLD_MANIFEST = "embeddings.json"  # an output begun before the rename, resumed under the name it has


class OutputError(ValueError):
    """An output location that holds something else; one line."""


@dataclass
class Part:
    split: str
    shard: str
    name: str  # <split>/part-NNNNN.parquet


class ShardImages(IterableDataset):
    """Batches (part index, keys, labels, images, last) of whole shards, each worker its own parts in order."""

    def __init__(self, parts: list[Part], cfg: DataConfig, info: Any, img_size: tuple[int, int], batch: int):
        super().__init__()
        self.parts, self.cfg, self.info, self.img_size, self.batch = parts, cfg, info, img_size, batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        w, n = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        transform, normalize = eval_transform(self.cfg, self.img_size), BatchNormalizer(self.cfg.mean, self.cfg.std)
        expected = {s: e for split in self.info.splits.values() for s, e in expected_of(split).items()}
        indexes = Indexes(self.cfg.cache_dir, self.cfg.cache_limit_gb, RetryPolicy.from_config(self.cfg), expected)
        labelled = self.info.num_classes > 0
        channels = int(self.info.pixels.get("channels", 3))
        try:
            for i in range(w, len(self.parts), n):
                local = indexes.get(self.parts[i].shard).path  # a remote shard: copied and checked first
                keys, names, labels, images, bad = [], [], [], [], 0
                for raw in tario.iter_raw_samples(local):
                    try:
                        img = tario.sample_image(raw, self.cfg.max_image_pixels)  # an array member too (pixels.py)
                    except tario.SampleError:
                        bad += 1
                        continue
                    label = self.label(raw) if labelled else -1
                    keys.append(f"{self.parts[i].split}/{raw.key}")  # a shard's keys repeat in the next split
                    names.append(tario.source_name(raw))
                    labels.append(label)
                    x = transform(img)  # (C, H, W): 3 for an RGB set, the set's channels for an array set
                    images.append(normalize(x, out=torch.empty(x.shape[0], *self.img_size)))
                    if len(keys) == self.batch:
                        yield {"part": i, "keys": keys, "names": names, "labels": labels, "images": torch.stack(images),
                               "last": False}
                        keys, names, labels, images = [], [], [], []
                yield {"part": i, "keys": keys, "names": names, "labels": labels, "bad": bad, "last": True,
                       "images": torch.stack(images) if images else torch.empty(0, channels, *self.img_size)}
        finally:
            indexes.close()


    def label(self, raw: tario.RawSample) -> int:
        """The sample's label, -1 where it has none (an embedding needs no label)."""
        try:
            return tario.parse_label(raw, self.info.label_key, self.info.num_classes)
        except tario.SampleError:
            return -1


def is_bucket(out: str) -> bool:
    return out.startswith("s3://")


def _read_manifest(out: str) -> dict[str, Any] | None:
    for name in (MANIFEST, OLD_MANIFEST):
        if is_bucket(out):
            if s3.exists(f"{out}/{name}"):
                return json.loads(read_bytes(f"{out}/{name}"))
        elif (Path(out) / name).is_file():
            return json.loads((Path(out) / name).read_text())
    return None


def _has_other_content(out: str) -> bool:
    if is_bucket(out):
        bucket, key = s3.split_url(out.rstrip("/") + "/")
        return bool(s3.client("write").list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1).get("KeyCount"))
    path = Path(out)
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def _write_manifest(out: str, manifest: dict[str, Any]) -> None:
    text = json.dumps(manifest, indent=1)
    if is_bucket(out):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(text)
        s3.upload(f.name, f"{out}/{MANIFEST}")
        os.unlink(f.name)
    else:
        Path(out).mkdir(parents=True, exist_ok=True)
        atomic.write_text(Path(out) / MANIFEST, text)


def _part_exists(out: str, part: Part) -> bool:
    return s3.exists(f"{out}/{part.name}") if is_bucket(out) else (Path(out) / part.name).is_file()


def _write_part(out: str, part: Part, table: Any) -> None:
    import pyarrow.parquet as pq

    if is_bucket(out):
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "part.parquet"
            pq.write_table(table, local)
            s3.upload(str(local), f"{out}/{part.name}")
        return
    path = Path(out) / part.name
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _table(part: Part, rows: dict[str, list], patch_tokens: bool) -> Any:
    import pyarrow as pa

    def matrix(chunks: list[np.ndarray]) -> Any:
        x = np.concatenate(chunks) if chunks else np.zeros((0, 1), np.float32)
        return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), pa.float32()), x.shape[1])

    columns = {"key": pa.array(rows["keys"], pa.string()), "split": pa.array([part.split] * len(rows["keys"])),
               "source": pa.array(rows["names"], pa.string()),
               "label": pa.array([x if x >= 0 else None for x in rows["labels"]], pa.int64()),
               "cls": matrix(rows["cls"]), "mean_patch": matrix(rows["mean_patch"])}
    if patch_tokens:
        columns["patch_tokens"] = matrix(rows["patch_tokens"])
    return pa.table(columns)


def start(out: str, manifest: dict[str, Any], env: DistEnv) -> None:
    """Rank 0: a new output (its manifest written) or the same one resumed; anything else refused (one line)."""
    error = None
    if env.is_main:
        found = _read_manifest(out)
        same = {k: v for k, v in (found or {}).items() if k in manifest}
        if found is not None and same != manifest:
            changed = ", ".join(k for k in manifest if same.get(k) != manifest[k])
            error = f"{out} holds embeddings of another run of embed.py (differs in: {changed}); give an empty --out"
        elif found is None and _has_other_content(out):
            error = f"{out} exists and holds other files (no {MANIFEST}): give an empty or new folder as --out"
        elif found is None:
            _write_manifest(out, manifest)
    if dist.is_initialized():
        said = [error]
        dist.broadcast_object_list(said, src=0)
        error = said[0]
    if error:
        raise OutputError(error)


def reading_config(backbone: Backbone, data_path: str, where: str) -> tuple[DataConfig, Any]:
    """The DataConfig (and the set's DatasetInfo) the backbone reads `data_path` with: its run's data.* there, the
    set's channels the model's (one line naming `where` otherwise), an array set's mean/std from dataset.json."""
    cfg = DataConfig(**{**backbone.data.__dict__, "path": data_path})
    info = dataset_info_of(cfg)
    return for_model(cfg, info, backbone.kwargs.get("in_chans", 3), where), info


def embed(backbone: Backbone, data_path: str, splits: list[str], out: str, env: DistEnv, device: torch.device,
          batch: int = 64, patch_tokens: bool = False, num_workers: int = 2) -> dict[str, int]:
    """Embed every sample of `splits`; this rank's counts {written, skipped (parts there), bad}."""
    cfg, info = reading_config(backbone, data_path, "--data")
    for split in splits:
        info.split(split)  # a DataError naming the splits there are
    parts = [Part(s, shard, f"{s}/part-{i:05d}.parquet") for s in splits for i, shard in enumerate(info.split(s).shards)]
    # Version 2: keys prefixed by their split, the source column, the manifest's '_' name (an output of version 1
    # is refused by `start` as another run's, not mixed into).
    manifest = {"format": "vit-pipeline-embeddings", "version": 2, "source": str(backbone.source),
                "checkpoint": backbone.tag or "export", "data": data_path, "splits": splits,
                "dim": backbone.model.embed_dim, "patch_tokens": patch_tokens, "img_size": list(backbone.kwargs["img_size"])
                if not isinstance(backbone.kwargs["img_size"], int) else [backbone.kwargs["img_size"]] * 2}
    start(out, manifest, env)
    mine = [p for p in parts[env.rank::env.world_size] if not _part_exists(out, p)]
    counts = {"written": 0, "skipped": len(parts[env.rank::env.world_size]) - len(mine), "bad": 0}
    model = backbone.model.to(device)
    img = manifest["img_size"]
    if mine:
        reap_workers_at_exit()
        workers = min(num_workers, len(mine))
        loader = DataLoader(ShardImages(mine, cfg, info, tuple(img), batch), batch_size=None, num_workers=workers,
                            multiprocessing_context=worker_context() if workers else None,
                            worker_init_fn=WorkerInit("embed") if workers else None)
        pending: dict[int, dict[str, list]] = {}
        for item in loader:
            rows = pending.setdefault(item["part"], {"keys": [], "names": [], "labels": [], "cls": [],
                                                     "mean_patch": [], "patch_tokens": []})
            if len(item["keys"]):
                with torch.no_grad():
                    tokens = model.forward_features(item["images"].to(device))
                rows["keys"] += item["keys"]
                rows["names"] += item["names"]
                rows["labels"] += item["labels"]
                feats = embedding(tokens, model)  # the features evaluate.py and eval.sets judge, side by side
                rows["cls"].append(feats[:, :model.embed_dim].cpu().numpy())
                rows["mean_patch"].append(feats[:, model.embed_dim:].cpu().numpy())
                if patch_tokens:
                    rows["patch_tokens"].append(tokens[:, model.num_prefix_tokens:].flatten(1).float().cpu().numpy())
            if item["last"]:
                _write_part(out, mine[item["part"]], _table(mine[item["part"]], pending.pop(item["part"]), patch_tokens))
                counts["written"] += len(rows["keys"])
                counts["bad"] += item["bad"]
    totals = torch.tensor([counts["written"], counts["bad"]], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(totals)
    if env.is_main:
        _write_manifest(out, {**manifest, "complete": True, "parts": len(parts)})
    return {**counts, "written_all": int(totals[0]), "bad_all": int(totals[1])}


def read_embeddings(out: str | Path) -> Any:
    """Every part of a local output as one pyarrow table (what a test or a notebook reads)."""
    import pyarrow.parquet as pq

    return pq.read_table(sorted(str(p) for p in Path(out).glob("*/part-*.parquet")))

