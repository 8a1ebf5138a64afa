"""pipeline/eval/: DINOv2's k-NN against a brute-force k-NN written out, the linear probe against
scikit-learn's logistic regression on the same cached features, eval.sets' bad input, and the features a run
is judged by equal to the exported backbone's."""

import dataclasses

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
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: 5 s on one thread, 50-100 s on two threads of a loaded 2-core machine
    try:
        probe = linear_probe(x[train], y[train], x[val], y[val], steps=800)
    finally:
        torch.set_num_threads(threads)
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


# ----------------------------------------------------------------------------- bad input, one line each

@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """A labelled set and the same images without labels (a folder of images, no class folders)."""
    from PIL import Image

    from pipeline.data.shards import synthetic_source, write_dataset
    from pipeline.data.sources import folder_source, synthetic_image

    root = tmp_path_factory.mktemp("sets")
    write_dataset(synthetic_source(48, 4, 16, val_fraction=0.25), root / "labelled", max_samples_per_shard=10,
                  progress=False, log=lambda _: None)
    images = root / "images"
    images.mkdir()
    for i in range(12):
        Image.fromarray(synthetic_image(i, i % 4, 4, (16, 16))).save(images / f"{i:03d}.png")
    write_dataset(folder_source(str(images), val_fraction=0.25), root / "unlabelled", progress=False, log=lambda _: None)
    return root


def test_a_set_without_labels_or_a_split_is_one_line_naming_the_key(sets):
    from pipeline.config import DataConfig
    from pipeline.data import DataError
    from pipeline.eval.sets import labelled_set

    with pytest.raises(DataError, match=r"^eval.sets.plain: .*unlabelled has no labels") as e:
        labelled_set(DataConfig(), str(sets / "unlabelled"), "train", "val", "eval.sets.plain")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"^--data: .* has no split 'test' \(it has: train, val\)"):
        labelled_set(DataConfig(), str(sets / "labelled"), "train", "test", "--data")
    cfg, info = labelled_set(DataConfig(), str(sets / "labelled"), "train", "val", "eval.sets.ok")
    assert cfg.path == str(sets / "labelled") and info.num_classes == 4


def test_eval_sets_config_keys_and_their_checks():
    from pipeline.config import ConfigError
    from pipeline.objectives import load_config

    cfg = load_config("configs/pretrain/mae_demo.yaml", ["eval.sets.digits=data/digits", "eval.memory_samples=100"])
    assert cfg.eval.sets == {"digits": "data/digits"} and cfg.eval.memory_samples == 100
    with pytest.raises(ConfigError, match="key 'eval.sets' must be a mapping NAME: PATH, each NAME letters"):
        load_config("configs/pretrain/mae_demo.yaml", ["eval.sets.a/b=data/digits"])
    with pytest.raises(ConfigError, match="unknown key 'eval.k'"):
        load_config("configs/pretrain/mae_demo.yaml", ["eval.k=3"])


# ----------------------------------------------------------------------------- the backbone outside training

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A supervised ViT's weights as our export writes them (metadata: the architecture), with a head."""
    from pipeline.model.vit import VisionTransformer, architecture
    from pipeline.model.weights import save_weights

    kwargs = dict(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=4)
    torch.manual_seed(0)
    model = VisionTransformer(**kwargs).eval()
    path = tmp_path_factory.mktemp("exported") / "vit.safetensors"
    save_weights(model.state_dict(), path, metadata={"step": "7", **{k: str(v) for k, v in
                                                                     architecture(VisionTransformer, kwargs).items()}})
    return path, model


def test_backbone_from_our_export_is_the_model_and_wrong_weights_are_one_line(exported, tmp_path):
    from pipeline.model.weights import WeightsError, save_weights
    from pipeline.run.backbone import load_backbone

    path, model = exported
    found = load_backbone(path)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(found.model(x), model(x))
    # The metadata says depth 2, the file holds one block: one line naming what does not fit.
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("blocks.1.")}
    meta = {k: v for k, v in __import__("safetensors").safe_open(str(path), "pt").metadata().items()}
    save_weights(state, tmp_path / "short.safetensors", metadata=meta)
    with pytest.raises(WeightsError, match=r"do not fit the architecture .*depth 2.*: they are .*depth 1") as e:
        load_backbone(tmp_path / "short.safetensors")
    assert "\n" not in str(e.value)


def test_timm_local_dir_round_trip_and_onnx_within_1e_4(exported, tmp_path):
    pytest.importorskip("onnxruntime")
    import timm

    from pipeline.config import DataConfig
    from pipeline.model.weights import WeightsError
    from pipeline.run.backbone import load_backbone
    from pipeline.run.export import ONNX_TOLERANCE, export_onnx, export_timm

    path, model = exported
    # A run's normalisation that is not timm's default: the export must carry it, not leave timm's in place.
    found = dataclasses.replace(load_backbone(path), data=DataConfig(mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3)))
    export_timm(found, tmp_path / "timm")
    loaded = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x)) and torch.equal(loaded.forward_features(x), model.forward_features(x))
    data_cfg = timm.data.resolve_data_config({}, model=loaded)
    assert (data_cfg["input_size"], tuple(data_cfg["mean"]), tuple(data_cfg["std"])) == (
        (3, 16, 16), (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))  # config.json holds lists
    assert "## Model" in (tmp_path / "timm" / "README.md").read_text()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(WeightsError, match="other exists and holds other files \\(notes.txt\\)"):
        export_timm(found, tmp_path / "other")
    # ONNX: three outputs, any batch size, within the tolerance of PyTorch under ONNX Runtime.
    (onnx_path,), worst = export_onnx(found, tmp_path / "onnx")
    assert worst <= ONNX_TOLERANCE
    import onnxruntime

    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["cls", "mean_patch", "logits"]
    # Against the model itself (not the export's own check): a batch size the export never saw.
    x5 = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        tokens = model.forward_features(x5)
        want = (tokens[:, 0], tokens[:, 1:].mean(1), model(x5))
    for got, ref in zip(session.run(None, {"images": x5.numpy()}), want):
        assert got.shape == tuple(ref.shape) and np.abs(got - ref.numpy()).max() <= ONNX_TOLERANCE
