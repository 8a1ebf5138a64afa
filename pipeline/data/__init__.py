"""Data: WebDataset shards (write, read), the elastic resumable train stream and the exactly-once eval pass."""

from .info import BadDataError, DataError, DatasetInfo, SplitInfo, read_dataset_info
from .loader import EvalLoader, TrainLoader, build_eval_loader, build_train_loader, merge_counters
from .tario import BAD_KINDS

__all__ = [
    "BAD_KINDS",
    "BadDataError",
    "DataError",
    "DatasetInfo",
    "EvalLoader",
    "SplitInfo",
    "TrainLoader",
    "build_eval_loader",
    "build_train_loader",
    "merge_counters",
    "read_dataset_info",
]
