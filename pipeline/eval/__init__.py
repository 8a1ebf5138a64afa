"""How every objective's features are judged, below the objectives: one feature loop, one k-NN, one linear probe.

    features.py   `Features` (a pass's features and labels, padding marked -1), `extract` (the loop that embeds
                  every batch of an eval loader), `embedding` (a run's features: class token + mean patch token)
    knn.py        `knn_accuracy` (DINOv2's weighted vote over all ranks, k 10/20/100, top-1 and top-5) and
                  `knn_loaders` (an objective's own pass and its labelled train subset as the memory)
    linear.py     `linear_probe`: DINOv2's grid of learning rates on frozen, cached features, chosen on a
                  held-out part of the train split
    sets.py       eval.sets: labelled shard sets judged at every evaluation of a run (k-NN)
    sets_config.py  the `eval` config section (light: read before torch is imported)

This package's __init__ imports nothing: a command reads its config (sets_config.py) before torch.
"""
