"""How every objective's features are judged, below the objectives: one feature loop and one k-NN.

    features.py  `Features` (a pass's features and labels, padding marked -1) and `extract`, the loop that
                 embeds every batch of an eval loader
    knn.py       `knn_top1` (DINO's weighted vote over all ranks) and `knn_loaders` (the validation pass and
                 the labelled train subset that is the k-NN memory)

MAE scores its encoder's pooled patch tokens, DINOv2 its teacher's class token: each gives `extract` its
own embedding and both vote the same way.
"""

from pipeline.eval.features import Features, extract
from pipeline.eval.knn import KNN_TEMPERATURE, knn_loaders, knn_top1

__all__ = ["KNN_TEMPERATURE", "Features", "extract", "knn_loaders", "knn_top1"]
