"""A C-channel model out of the pipeline (issue 62): an RGB timm file fine-tuned on 4-channel uint16 shards (its
patch embedding adapted, pipeline/model/channels.py), then launch/evaluate.py, launch/embed.py, the timm export
(its in_chans in config.json, loaded back by timm) and the ONNX export (a 4-channel input, ONNX Runtime) agree on
it: the same features of the same images within 1e-5, and evaluate's k-NN the k-NN of embed's vectors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from tests.integration.runs import TINY, run_here
from tests.unit.test_pixels_read import array_set
from tests.unit.test_recipe_matrix import launcher

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")
AGREE = 1e-5


@pytest.mark.slow
def test_a_four_channel_fine_tune_is_judged_embedded_and_exported_alike(tmp_path, capsys):
    import onnxruntime
    import pandas
    import pyarrow.parquet as pq
    import timm

    from pipeline.config import DataConfig
    from pipeline.data import build_eval_loader
    from pipeline.eval.features import embedding
    from pipeline.eval.knn import knn_accuracy

    shards = array_set(tmp_path, 4, "uint16", n=48)
    theirs = timm.models.vision_transformer.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=7)
    torch.save(theirs.state_dict(), tmp_path / "rgb_timm.pth")
    run_dir = tmp_path / "ft"
    arch = ["model.variant=vit_ti16", "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=2"]
    out = run_here("finetune.py", "configs/finetune/demo.yaml",
                   [*TINY, *arch, f"data.path={shards}", "data.mean=null", "data.std=null", f"run.dir={run_dir}",
                    "train.steps=2", "train.eval_every=0", "train.ckpt_every=2", "deepspeed.bf16=false"],
                   extra=["--from", str(tmp_path / "rgb_timm.pth"), "--res", "16"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "patch projection RGB -> 4 channels (timm's adapt_input_conv)" in out.stdout + out.stderr

    # The val split's images as every command's eval loader gives them: the run's own normalisation.
    saved = (run_dir / "config.yaml").read_text()
    assert "in_chans: 4" in saved
    info = json.loads((shards / "dataset.json").read_text())
    data = DataConfig(path=str(shards), val_split="val", mean=tuple(info["mean"]), std=tuple(info["std"]),
                      num_workers=0)
    images = torch.cat([b[0] for b in build_eval_loader(data, 16, 64)])[:info["splits"]["val"]["num_samples"]]
    assert images.shape[1] == 4

    assert launcher("export_weights").main([str(run_dir), "--format", "timm", "--out", str(tmp_path / "timm")]) == 0
    assert json.loads((tmp_path / "timm" / "config.json").read_text())["model_args"]["in_chans"] == 4
    model = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    assert timm.data.resolve_data_config({}, model=model)["input_size"] == (4, 16, 16)
    with torch.no_grad():
        features = embedding(model.forward_features(images), model)  # [class token, mean patch]
    width = features.shape[1] // 2

    assert launcher("export_weights").main([str(run_dir), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 0
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    cls, mean_patch = session.run(None, {"images": images.numpy()})[:2]
    torch.testing.assert_close(torch.from_numpy(np.concatenate([cls, mean_patch], 1)), features, atol=AGREE, rtol=0)

    assert launcher("embed").main(["--from", str(run_dir), "--data", str(shards), "--out", str(tmp_path / "emb"),
                                   "--workers", "0", "--batch-size", "16"]) == 0
    rows = [pq.read_table(p).to_pandas() for p in sorted((tmp_path / "emb").rglob("*.parquet"))]
    table = pandas.concat(rows)
    val, train = table[table["split"] == "val"], table[table["split"] == "train"]
    embedded = {str(k): np.asarray(v) for k, v in zip(val["key"], val["cls"])}
    assert len(embedded) == len(images)
    # embed's rows are keyed; the eval loader's order is the split's: compare as sets of vectors, each matched
    ours = features[:, :width].numpy()
    for vector in embedded.values():
        assert np.abs(ours - vector).max(1).min() <= AGREE

    # The MLflow Model a tracked run logs (pipeline/tracking/served.py): the set's own uint16 arrays in, embed's
    # vectors out, key by key.
    import mlflow

    from pipeline.data import dataset_info_of, tario
    from pipeline.tracking.served import save_served_model

    folder = save_served_model(run_dir / "model.safetensors", str(shards), tmp_path / "served")
    raws = [r for shard in dataset_info_of(DataConfig(path=str(shards))).split("val").shards
            for r in tario.iter_raw_samples(str(shards / shard))]
    arrays = np.stack([tario.sample_image(r) for r in raws])
    assert arrays.dtype == np.uint16 and arrays.shape[1:] == (16, 16, 4)
    served = mlflow.pyfunc.load_model(str(folder)).predict(arrays)["cls"]
    assert max(np.abs(served[i] - embedded[f"val/{r.key}"]).max() for i, r in enumerate(raws)) <= AGREE

    capsys.readouterr()
    assert launcher("evaluate").main(["--from", str(run_dir), "--data", str(shards), "--no-mlflow",
                                      "--protocol", "knn", "--batch-size", "16"]) == 0
    printed = capsys.readouterr().out
    k = int(re.search(r"k-NN k=(\d+)", printed).group(1))
    top1 = float(re.search(r"k-NN k=\d+\D*?([\d.]+)%", printed).group(1))
    as_tensor = lambda t: torch.nn.functional.normalize(torch.tensor(np.stack(t["cls"].to_list())), dim=-1)  # noqa: E731
    labels = lambda t: torch.tensor(t["label"].to_numpy())  # noqa: E731
    want = knn_accuracy(as_tensor(val), labels(val), as_tensor(train), labels(train), ks=(k,))[k][0]
    assert top1 == pytest.approx(100 * want, abs=0.01), printed

    # An RGB model (our export's layout: it says its architecture) on these 4-channel shards: one line naming the
    # set and both channel counts, exit 1, before anything is read.
    from pipeline.model.vit import VisionTransformer, architecture
    from pipeline.model.weights import save_weights

    kwargs = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0)
    save_weights(VisionTransformer(**kwargs).state_dict(), tmp_path / "rgb.safetensors", metadata={
        "step": "1", **{k: str(v) for k, v in architecture(VisionTransformer, kwargs).items()}})
    for command in ("evaluate", "embed"):
        args = ["--out", str(tmp_path / "emb3"), "--workers", "0"] if command == "embed" else ["--no-mlflow"]
        code = launcher(command).main(["--from", str(tmp_path / "rgb.safetensors"), "--data", str(shards), *args])
        err = capsys.readouterr().err
        assert code == 1 and re.search(r"--data: .* holds 4-channel images and the model takes 3", err), err
        assert err.strip().count("\n") == 0


@pytest.mark.slow
def test_a_real_dicom_file_goes_through_make_shards_a_run_and_embed(tmp_path):
    """pydicom's own CT_small.dcm (128 x 128, Hounsfield units after its rescale) as two classes of copies:
    make_shards (the command) -> a 2-step supervised run -> launch/embed.py, whose vectors are the run's model's
    features of the slice as the eval loader gives it."""
    import shutil
    import subprocess
    import sys

    import pandas
    import pydicom

    from pipeline.config import DataConfig
    from pipeline.data import build_eval_loader
    from pipeline.eval.features import embedding
    from pipeline.run.backbone import load_backbone
    from tests.integration.runs import ROOT

    path = pydicom.data.get_testdata_file("CT_small.dcm")
    for c in ("a", "b"):
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(6):
            shutil.copy(path, tmp_path / "src" / c / f"{c}{i}.dcm")
    shards = tmp_path / "shards"
    subprocess.run([sys.executable, "launch/make_shards.py", "--source", f"folder:{tmp_path / 'src'}", "--out",
                    str(shards), "--val-fraction", "0.34", "--no-progress"], cwd=ROOT, check=True)
    info = json.loads((shards / "dataset.json").read_text())
    assert (info["channels"], info["dtype"], info["image_format"]) == (1, "float32", "npy")
    run_dir = tmp_path / "run"
    out = run_here("pretrain.py", "configs/pretrain/demo.yaml",
                   [*TINY, f"data.path={shards}", "data.mean=null", "data.std=null", f"run.dir={run_dir}",
                    "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=2", "train.eval_every=2",
                    "deepspeed.bf16=false"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert launcher("embed").main(["--from", str(run_dir), "--data", str(shards), "--out", str(tmp_path / "emb"),
                                   "--workers", "0", "--splits", "val"]) == 0
    table = pandas.read_parquet(tmp_path / "emb")
    backbone = load_backbone(run_dir)
    data = DataConfig(path=str(shards), val_split="val", mean=tuple(info["mean"]), std=tuple(info["std"]),
                      num_workers=0)
    images = next(iter(build_eval_loader(data, 16, 4)))[0][:1]  # every val sample is the same slice
    with torch.no_grad():
        want = embedding(backbone.model.forward_features(images), backbone.model)[0, :backbone.model.embed_dim]
    assert len(table) == info["splits"]["val"]["num_samples"]
    for vector in table["cls"]:
        np.testing.assert_allclose(np.asarray(vector), want.numpy(), atol=AGREE, rtol=0)


@pytest.mark.slow  # three runs made and read by five commands each, in this process: 25 s at load 8
@pytest.mark.parametrize("recipe", ["mae", "dinov2", "dinov3"])
def test_a_c_channel_ssl_runs_backbone_goes_through_every_downstream_command(recipe, tmp_path, capsys, monkeypatch):
    """An MAE run's encoder, a DINOv2 and a DINOv3 run's teacher, of a run on 4-channel uint16 shards (as its
    trainer leaves the run directory, tests/unit/recipe_runs.py, random weights): launch/evaluate.py, embed.py, both
    exports (timm's features and ONNX Runtime's equal to the objective's own of 4-channel images) and the fine-tune's
    read of --from, as test_recipe_matrix.py runs them on RGB runs."""
    from tests.unit.recipe_runs import tiny_run
    from tests.unit.test_recipe_matrix import COMMANDS

    shards = array_set(tmp_path, 4, "uint16", n=48)
    src = tiny_run(recipe, tmp_path / "run", shards)
    assert src.in_chans == 4 and "in_chans: 4" in (src.path / "config.yaml").read_text()
    for name, command in COMMANDS.items():
        (tmp_path / name).mkdir()
        command(src, shards, tmp_path / name, capsys, monkeypatch)
