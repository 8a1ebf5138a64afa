"""Data: WebDataset shards (write, read), the elastic resumable train stream and the exactly-once eval pass.

Writing (launch/make_shards.py):
    sources.py     what to write: an image folder, scikit-learn's digits, synthetic images
    shards.py      ShardWriter (shard + its index + digest), write_dataset, index_shards -> dataset.json
    bucket.py      writing under an s3:// prefix, reading a remote shard once to index it
Reading (the trainer):
    info.py        dataset.json / timm's _info.json, checked against the shards
    mix.py         data.sources: each source read on its own, weights, one label space, the mix's history
    order.py       the global order: partitions, passes, which sample a position holds
    mix_order.py   a mixture's order: every source at its weight in every global batch, node-local
    nodes.py       which node this process is on (what its cache must hold)
    index.py       per-shard index files
    cache.py       the node's cache of remote shards: copies held while read, evicted only when nobody holds them
    reader.py      random access to samples: a shard in place or its held copy
    fetch.py       fetch ahead: the rank's next shards into the cache, in the background
    tario.py       tar members -> image and label; streaming a shard from its start
    bad.py         the data errors, bad-data counters and the stop rule
    stream.py      the train stream: one micro batch as a pure function of its index (TrainStream, in workers)
    train_loader.py  the rank's side of it (TrainLoader): the DataLoader, order check, buffers, state
    eval.py        the exactly-once eval pass
    transforms.py  timm's train/eval transforms, Mixup/CutMix, normalisation
    gpu_decode.py  data.decode_device=cuda: decode and crop on the GPU
    loader.py      the builders: build_train_loader (with the cache check), build_eval_loader
"""

from .bad import BadDataError, DataError
from .eval import EvalFailed, raise_if_any_failed
from .info import DatasetInfo, SplitInfo, dataset_info_of, read_dataset_info
from .loader import EvalLoader, TrainLoader, build_eval_loader, build_train_loader, label_free, merge_counters
from .mix import read_data
from .tario import BAD_KINDS

__all__ = [
    "BAD_KINDS",
    "BadDataError",
    "DataError",
    "DatasetInfo",
    "EvalFailed",
    "EvalLoader",
    "SplitInfo",
    "TrainLoader",
    "build_eval_loader",
    "build_train_loader",
    "dataset_info_of",
    "label_free",
    "merge_counters",
    "raise_if_any_failed",
    "read_data",
    "read_dataset_info",
]
