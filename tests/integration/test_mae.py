"""MAE pretraining end to end on CPU (gloo): preempted on 2 ranks, resumed on 1, it ends where the
uninterrupted run ends; ZeRO-3 with gradient checkpointing trains on label-free shards; a supervised run
on those shards stops with one line."""

import json
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from pipeline.model.mae import sincos_pos_embed_2d
from tests.integration.runs import (
    PYTHON,
    ROOT,
    TINY,
    TORCHRUN,
    WORKERS,
    assert_same_weights,
    assert_sets_judged_alike,
    env,
    free_port,
    metrics,
    run,
    run_and_signal,
    run_here,
    weights,
)

pytestmark = pytest.mark.dist
CONFIG = "configs/pretrain/mae_demo.yaml"
MAE = ["model.objective=mae", "mae.decoder_embed_dim=16", "mae.decoder_depth=1", "mae.decoder_num_heads=2",
       "mae.knn_train_samples=64", "mae.recon_images=4", "train.grad_clip=0.0"]


def base(data, run_dir, zero, steps=12, *extra):
    return [*TINY, *MAE, f"data.path={data}", f"run.dir={run_dir}", f"deepspeed.zero_stage={zero}",
            f"train.steps={steps}", "train.ckpt_every=4", "train.eval_every=0", "train.keep_last=5", *extra]


def test_mae_preempted_on_2_ranks_resumes_on_1_and_ends_where_the_uninterrupted_run_ends(shards, label_free,
                                                                                         noisy_labels, tmp_path,
                                                                                         capsys, monkeypatch):
    # Pretrained on shards without labels, judged at every evaluation on a labelled set (eval.sets).
    fp32 = ["deepspeed.bf16=false", f"eval.sets.synth={noisy_labels}", "train.eval_every=4"]
    ref_dir = tmp_path / "ref"
    store = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}  # the reference is tracked: evaluate.py nests
    ref = run("pretrain.py", CONFIG, base(label_free, ref_dir, 1, 12, *fp32, "tracking.enabled=true"), ranks=2,
              extra_env=store)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    run_dir = tmp_path / "preempted"
    code, out = run_and_signal("pretrain.py", CONFIG, base(label_free, run_dir, 1, 12, *fp32), when="step 4/12")
    assert code == 75, out[-3000:]
    assert not (run_dir / "model.safetensors").exists()
    # Loader workers in the resumed run, none in the reference: the same batches.
    resumed = run_here("pretrain.py", CONFIG, base(label_free, run_dir, 1, 12, *fp32, WORKERS))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout changed (world size 2 -> 1)" in resumed.stdout
    # Same masks (from each sample's global position), same samples, same updates: the same weights.
    assert_same_weights(weights(ref_dir), weights(run_dir))
    exported = weights(run_dir)  # Meta's layout, the fixed tables included (exact float32)
    assert {"decoder_pred.weight", "mask_token", "pos_embed", "decoder_pos_embed"} <= exported.keys()
    assert torch.equal(exported["pos_embed"], sincos_pos_embed_2d(32, 4))
    # The evaluation: reconstruction loss, the image, and eval.sets' k-NN of the labelled set at every
    # evaluation, the same on 1 rank after the resume as on 2 uninterrupted (steps 8 and 12).
    evals, ref_evals = assert_sets_judged_alike(run_dir, ref_dir, "eval/recon_loss")
    assert evals[12]["eval/recon_loss"] == ref_evals[12]["eval/recon_loss"] and "eval/knn_top1" not in evals[12]
    assert (run_dir / "reconstructions" / "step00000012.png").is_file()

    # Its encoder fine-tunes (as a supervised ViT, the decoder left out) at twice the resolution.
    ft_dir = tmp_path / "finetune"
    ft = run_here("finetune.py", "configs/finetune/demo.yaml",
                  [*TINY, f"data.path={shards}", f"run.dir={ft_dir}", "train.steps=2", "train.eval_every=0"],
                  extra=["--from", str(run_dir), "--res", "32"])
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    assert "ours (an MAE run's MaskedAutoencoderViT)" in ft.stdout and "left out: the decoder" in ft.stdout
    assert weights(ft_dir)["pos_embed"].shape == (1, 65, 32)  # 8x8 grid + class token

    # And a linear probe trains only its head on the frozen encoder.
    probe_dir = tmp_path / "probe"
    probe = run_here("finetune.py", "configs/finetune/demo.yaml",
                     [*TINY, f"data.path={shards}", f"run.dir={probe_dir}", "train.steps=2", "train.eval_every=0",
                      "deepspeed.bf16=false"],  # frozen weights stay as loaded (bf16 would round them)
                     extra=["--from", str(run_dir), "--res", "16", "--probe"])
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-3000:]
    assert "linear probe:" in probe.stdout
    probed = weights(probe_dir)
    assert_same_weights({k: v for k, v in probed.items() if k.startswith("blocks.")},
                        {k: v for k, v in exported.items() if k.startswith("blocks.")})  # the encoder did not move
    assert "head.1.weight" in probed
    # The probe's BatchNorm statistics are exported with it (2 steps of momentum 0.1 moved them off 0).
    assert int(probed["head.0.num_batches_tracked"]) > 0 and probed["head.0.running_mean"].abs().sum() > 0

    judge_and_embed(ref_dir, shards, tmp_path, store, capsys, monkeypatch)


def judge_and_embed(run_dir, shards, tmp_path, store, capsys, monkeypatch):
    """launch/evaluate.py over every checkpoint (a table, MLflow runs nested under the run's), then
    launch/embed.py on 2 ranks equal to the backbone's forward, each sample once, and a 1-rank embed killed
    after its first part and started again equal to it. About 40 s of the test's time on a quiet machine."""
    from mlflow.tracking import MlflowClient

    from pipeline.run.backbone import load_backbone
    from pipeline.run.embed import ShardImages, read_embeddings
    from pipeline.tracking.sync import recorded_run_id

    # launch/evaluate.py's and embed.py's mains in this process where one process of one rank is not the subject:
    # the same code as the commands, without an interpreter's start and the imports (5-8 s each on 2 cores).
    sys.path.insert(0, str(ROOT / "launch"))
    try:
        from embed import main as embed_main
        from evaluate import main as evaluate_main
    finally:
        sys.path.pop(0)
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setenv("MLFLOW_TRACKING_URI", store["MLFLOW_TRACKING_URI"])
        code = evaluate_main(["--from", str(run_dir), "--all-steps", "--data", str(shards), "--protocol", "knn,linear",
                              "--name", "synth"])
    judged = capsys.readouterr()
    assert code == 0, judged.out[-3000:] + judged.err[-3000:]
    table = judged.out[judged.out.index("checkpoint  protocol"):]
    for step in (4, 8, 12):
        assert re.search(rf"step {step} +k-NN k=20 ", table) and re.search(rf"step {step} +linear \(lr ", table), table
    parent = recorded_run_id(run_dir, store["MLFLOW_TRACKING_URI"])
    client = MlflowClient(store["MLFLOW_TRACKING_URI"])
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                   f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.info.run_name for r in children) == ["evaluate synth @ step 12", "evaluate synth @ step 4",
                                                         "evaluate synth @ step 8", "evaluate synth vs step"]
    curve = client.get_metric_history(next(r for r in children if r.info.run_name.endswith("vs step")).info.run_id,
                                      "eval/synth/knn_top1")
    assert [m.step for m in curve] == [4, 8, 12]

    out2 = tmp_path / "emb2"
    two = subprocess.run([TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), "launch/embed.py",
                          "--from", str(run_dir), "--data", str(shards), "--out", str(out2)], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    table2 = read_embeddings(out2)
    info = json.loads((shards / "dataset.json").read_text())
    total = sum(s["num_samples"] for s in info["splits"].values())
    assert table2.num_rows == total and len(set(zip(table2["split"].to_pylist(), table2["key"].to_pylist()))) == total
    # Tensor by tensor: the backbone's forward on a part's images (read as embed.py reads them).
    backbone = load_backbone(run_dir)
    from pipeline.data import dataset_info_of
    from pipeline.run.embed import Part

    data = type(backbone.data)(**{**backbone.data.__dict__, "path": str(shards)})
    shard0 = dataset_info_of(data).split("val").shards[0]
    batch = next(iter(ShardImages([Part("val", shard0, "val/part-00000.parquet")], data, dataset_info_of(data),
                                  (16, 16), 1000)))
    with torch.no_grad():
        tokens = backbone.model.forward_features(batch["images"])
    part = read_embeddings(out2).filter(__import__("pyarrow").compute.equal(table2["split"], "val"))
    rows = {k: i for i, k in enumerate(part["key"].to_pylist())}
    got = np.stack([part["cls"][rows[k]].values.to_numpy() for k in batch["keys"]])
    assert np.array_equal(got, tokens[:, 0].numpy())

    # Killed after its first part, started again: the same output (the parts there kept, the rest written).
    out1 = tmp_path / "emb1"
    argv = [PYTHON, "launch/embed.py", "--from", str(run_dir), "--data", str(shards), "--out", str(out1),
            "--workers", "0"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(out1.glob("*/part-*.parquet")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    written = len(list(out1.glob("*/part-*.parquet")))
    assert 0 < written < len(list(out2.glob("*/part-*.parquet")))
    capsys.readouterr()
    assert embed_main(argv[2:]) == 0, capsys.readouterr()  # started again (in this process: the kill was the process's)
    assert read_embeddings(out1).equals(table2)
    # An output folder holding something else is refused with one line.
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert embed_main([*argv[2:-4], "--out", str(tmp_path / "busy")]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "holds other files" in err, err


def test_mae_at_zero3_with_gradient_checkpointing_trains_on_label_free_shards(label_free, tmp_path):
    run_dir = tmp_path / "zero3"
    out = run("pretrain.py", CONFIG, base(label_free, run_dir, 3, 16, "train.log_every=4",
                                          "model.grad_checkpointing=true"), ranks=2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [m["metrics"]["train/loss"] for m in metrics(run_dir) if "train/loss" in m["metrics"]]
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    final = [m["metrics"] for m in metrics(run_dir) if "eval/recon_loss" in m["metrics"]][-1]
    assert "eval/knn_top1" not in final  # no labels: no k-NN
    w = weights(run_dir)  # consolidated from ZeRO-3 partitions: full shapes
    assert w["decoder_pred.weight"].shape == (4 * 4 * 3, 16) and w["pos_embed"].shape == (1, 17, 32)
    assert (run_dir / "reconstructions" / "step00000016.png").is_file()


def test_supervised_run_on_label_free_shards_stops_with_one_line(label_free, tmp_path):
    out = run_here("pretrain.py", "configs/pretrain/demo.yaml",
                   [*TINY, f"data.path={label_free}", f"run.dir={tmp_path / 'sup'}", "train.steps=2"])
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no labels" in errors[0] and "model.objective=mae" in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    shutil.rmtree(tmp_path / "sup", ignore_errors=True)
