"""pipeline/eval/: DINOv2's k-NN against a brute-force k-NN written out, the linear probe against
scikit-learn's logistic regression on the same cached features, eval.sets' bad input, and the features a run
is judged by equal to the exported backbone's."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.eval.features import class_tokens, embedding
from pipeline.eval.knn import knn_accuracy
from pipeline.eval.linear import linear_probe


def brute_force_knn(val, val_labels, mem, mem_labels, k, temperature=0.07):
    """One sample at a time, as the protocol reads: the k most similar memory rows vote exp(sim / T)."""
    top1 = top5 = 0
    for x, y in zip(val, val_labels):
        sims = [float(np.dot(x, m)) for m in mem]
        nearest = sorted(range(len(mem)), key=lambda i: -sims[i])[:k]
        votes = {}
        for i in nearest:
            votes[int(mem_labels[i])] = votes.get(int(mem_labels[i]), 0.0) + np.exp(sims[i] / temperature)
        ranked = sorted(votes, key=lambda c: -votes[c])
        top1 += ranked[0] == y
        top5 += y in ranked[:5]
    return top1 / len(val), top5 / len(val)


def clustered(n, classes, dim, spread, seed):
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=gen)
    labels = torch.randint(0, classes, (n,), generator=gen)
    return centres[labels] + spread * torch.randn(n, dim, generator=gen), labels


def test_knn_equals_brute_force_for_each_k():
    rows, labels = clustered(380, 12, 16, 1.5, 0)
    mem, mem_labels, val, val_labels = rows[:300], labels[:300], rows[300:], labels[300:]
    mem, val = F.normalize(mem, dim=-1), F.normalize(val, dim=-1)
    # Padding rows (label -1) on both sides are left out, as an eval pass's.
    pad = torch.zeros(5, 16)
    found = knn_accuracy(torch.cat([val, pad]), torch.cat([val_labels, torch.full((5,), -1)]),
                         torch.cat([mem, pad]), torch.cat([mem_labels, torch.full((5,), -1)]), ks=(1, 10, 20, 100))
    for k in (1, 10, 20, 100):
        want = brute_force_knn(val.numpy(), val_labels.numpy(), mem.numpy(), mem_labels.numpy(), k)
        assert found[k] == pytest.approx(want, abs=1e-9), k
    assert 0.2 < found[20][0] < 1.0 and found[20][1] > found[20][0]  # neither trivial nor perfect: it can fail


def test_linear_probe_is_within_a_point_of_scikit_learns_logistic_regression():
    linear_model = pytest.importorskip("sklearn.linear_model")
    # The digits' pixels as cached features: 64-D, 10 classes, one fifth held as the validation split.
    datasets = pytest.importorskip("sklearn.datasets")
    x, y = datasets.load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, val = perm[:1437], perm[1437:]
    probe = linear_probe(x[train], y[train], x[val], y[val], steps=1500)
    reference = linear_model.LogisticRegression(max_iter=5000).fit(x[train].numpy(), y[train].numpy())
    sklearn_top1 = float((reference.predict(x[val].numpy()) == y[val].numpy()).mean())
    assert abs(probe.top1 - sklearn_top1) <= 0.01, (probe.top1, sklearn_top1, probe.lr)
    assert probe.top1 > 0.9 and len(probe.held_out) == 13
    # The grid's extremes learn less on the held-out part than the chosen one: the choice is a real one.
    assert probe.held_out[probe.lr] > probe.held_out[1e-5]


def test_embedding_is_class_token_and_patch_mean_and_knn_reads_the_normalised_class_token():
    from pipeline.model.vit import VisionTransformer

    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=8, depth=1, num_heads=2, num_classes=0,
                              reg_tokens=2, no_embed_class=True).eval()
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        tokens = model.forward_tokens(images)
        rows = embedding(model(images, features=True), model)
    assert torch.equal(rows[:, :8], tokens.cls_token) and torch.allclose(rows[:, 8:], tokens.patch_tokens.mean(1))
    assert torch.allclose(class_tokens(rows), F.normalize(tokens.cls_token, dim=-1))
