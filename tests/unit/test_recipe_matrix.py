"""Every command downstream of training on every recipe of RECIPES and on every foreign layout the recipes read:
launch/evaluate.py (k-NN and linear), launch/embed.py, launch/export_weights.py --format timm (loaded back by
timm, the features equal) and --format onnx (ONNX Runtime, equal; at two sizes for a RoPE backbone), and the
fine-tune's read of --from (a run directory, its export, a file). A recipe added to RECIPES is in the matrix as
soon as it has a demo config (tests/unit/recipe_runs.py); one that cannot be judged, embedded or exported fails.

Each source is made once per module without training (recipe_runs.py: a run directory as its trainer leaves it,
or a file as its makers write it) with the features it must give; the launchers' main() runs in this process
(what the command runs, without an interpreter's start each). A bad source of each kind is one line and exit 1
in every launcher.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.eval.features import embedding
from tests.unit.recipe_runs import (
    FOREIGN,
    OPTIONS,
    ROOT,
    SHRINK,
    SOURCES,
    Source,
    foreign_file,
    labelled_set,
    tiny_run,
)

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")
ATOL_TIMM, ATOL_ONNX = 1e-5, 1e-4  # float32 both ways; ONNX Runtime's kernels sum in another order


def launcher(name: str):
    """launch/<name>.py as a module (its main)."""
    spec = importlib.util.spec_from_file_location(f"launch_{name}", ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return labelled_set(tmp_path_factory.mktemp("set") / "labelled")


@pytest.fixture(scope="module")
def sources(tmp_path_factory, data):
    """source name -> Source, each made on first use."""
    root, built = tmp_path_factory.mktemp("sources"), {}

    def get(name: str) -> Source:
        if name not in built:
            kind, what = name.split("-", 1)
            built[name] = (tiny_run(what, root / name, data) if kind == "run" else
                           tiny_run(OPTIONS[what][0], root / name, data, OPTIONS[what][1]) if kind == "option" else
                           foreign_file(what, root / name))
        return built[name]

    return get


def images(src: Source, size: int | None = None, batch: int = 2) -> torch.Tensor:
    side = size or src.img_size
    return torch.randn(batch, src.in_chans, side, side, generator=torch.Generator().manual_seed(side))


def evaluate(src: Source, data: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    # The probe's grid at 20 SGD steps, not 2000: what is tested here is that the backbone is read and judged
    # (the probe itself: tests/unit/test_eval.py); 2000 steps x 13 rates cost 15 s a cell.
    from pipeline.eval import linear
    from pipeline.run import judge

    monkeypatch.setattr(judge, "linear_probe", functools.partial(linear.linear_probe, steps=20))
    code = launcher("evaluate").main(["--from", str(src.path), "--data", str(data), "--no-mlflow", "--batch-size", "16"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "k-NN k=10" in out.out and "linear (lr" in out.out, out.out


def embed(src: Source, data: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    import pyarrow.parquet as pq

    code = launcher("embed").main(["--from", str(src.path), "--data", str(data), "--out", str(tmp_path / "emb"),
                                   "--workers", "0", "--batch-size", "16"])
    assert code == 0, capsys.readouterr().err
    parts = sorted((tmp_path / "emb").rglob("*.parquet"))
    width = src.reference(images(src, batch=1)).shape[1] // 2
    assert sum(pq.read_metadata(p).num_rows for p in parts) == 48  # every sample of both splits, once
    assert all(pq.read_schema(p).field("cls").type.list_size == width for p in parts)


def export_timm(src: Source, data: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    import timm

    code = launcher("export_weights").main([str(src.path), "--format", "timm", "--out", str(tmp_path / "timm")])
    if src.timm_class is None:  # no timm class builds it (a conv stem): refused in one line, nothing written
        err = capsys.readouterr().err
        assert code == 1 and "has no equivalent in timm's" in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "timm").exists()
        return
    assert code == 0, capsys.readouterr().err
    model = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    assert type(model).__name__ == src.timm_class
    x = images(src)
    with torch.no_grad():
        torch.testing.assert_close(embedding(model.forward_features(x), model), src.reference(x), atol=ATOL_TIMM,
                                   rtol=0)


def export_onnx(src: Source, data: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    import onnxruntime

    code = launcher("export_weights").main([str(src.path), "--format", "onnx", "--out", str(tmp_path / "onnx")])
    assert code == 0, capsys.readouterr().err
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    # A RoPE backbone (no position table) at the trained size and another; a learned table at its own.
    sizes = [src.img_size] + ([src.img_size + 32] if src.timm_class == "Eva" else [])
    for size in sizes:
        x = images(src, size, batch=3)
        cls, mean_patch = session.run(None, {"images": x.numpy()})[:2]
        got = torch.cat([torch.from_numpy(cls), torch.from_numpy(mean_patch)], dim=1)
        torch.testing.assert_close(got, src.reference(x), atol=ATOL_ONNX, rtol=0)


def finetune(src: Source, data: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """What launch/finetune.py reads of --from, as a user types it (a run directory or its export without
    --config), loaded into the model it builds: every backbone tensor but the replaced head and final norm."""
    from pipeline import commands
    from pipeline.model.dinov3 import build_backbone
    from pipeline.model.variants import model_kwargs_from_config
    from pipeline.run.backbone import load_backbone
    from pipeline.run.finetune import prepare_finetune

    froms = [src.path] if src.path.is_file() else [src.path, src.path / "model.safetensors"]
    for source in froms:
        res = [] if "--res" in src.finetune else ["--res", str(src.img_size)]
        args = commands.parse_finetune_args(["--from", str(source), *res, *src.finetune,
                                             f"run.dir={tmp_path / 'ft'}", f"data.path={data}"])
        cfg, _ = commands.finetune_config(args)
        cfg, load = prepare_finetune(cfg, None)
        model = build_backbone(model_kwargs_from_config(cfg.model, num_classes=4))  # (the set's classes)
        load(model)
        backbone = load_backbone(source).model
        assert type(model) is type(backbone)
        tuned, read = model.state_dict(), backbone.state_dict()
        kept = [k for k in read if not k.startswith(("head.", "norm.", "fc_norm.")) and k in tuned]
        assert len(kept) >= len(read) - 6, sorted(set(read) - set(kept))
        for key in kept:
            if tuned[key].shape == read[key].shape:  # (a position table resized to --res is compared at its size)
                assert torch.equal(tuned[key], read[key]), key
    # ... and trains on it: one step of the fine-tune command from the first --from, its loss finite, its file written
    from tests.integration.runs import run_here

    out = tmp_path / "ft-step"
    res = [] if "--res" in src.finetune else ["--res", str(src.img_size)]
    done = run_here("finetune.py", None, [f"run.dir={out}", f"data.path={data}", "train.steps=1", "train.log_every=1",
                                          "train.eval_every=0", "train.ckpt_every=0", "tracking.enabled=false"],
                    extra=["--from", str(froms[0]), *res, *src.finetune])
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [r["metrics"]["train/loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "train/loss" in r["metrics"]]
    assert losses and all(math.isfinite(v) for v in losses), losses
    assert (out / "model.safetensors").is_file()


COMMANDS = {f.__name__: f for f in (evaluate, embed, export_timm, export_onnx, finetune)}


@pytest.mark.slow  # 54 cells, about a second each: `make test` (CI) runs them, `make test-fast` leaves them out
@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("source", SOURCES)
def test_every_command_reads_every_recipe_and_layout(source, command, sources, data, tmp_path, capsys, monkeypatch):
    COMMANDS[command](sources(source), data, tmp_path, capsys, monkeypatch)


# ----------------------------------------------------------------------------- a bad source: one line, exit 1

def bad_source(kind: str, good: Path, tmp_path: Path) -> Path:
    """A DINOv3 run directory made wrong in one way: its config of another width than its weights, its weights
    a text file, its weights truncated (and, as every tiny run here, no checkpoint: a stage cannot continue it)."""
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    weights = bad / "model.safetensors"
    if kind == "other_width":
        text = (bad / "config.yaml").read_text()
        (bad / "config.yaml").write_text(text.replace("embed_dim: 96", "embed_dim: 64").replace("num_heads: 3",
                                                                                                 "num_heads: 2"))
    elif kind == "not_weights":
        weights.write_text("the weights are on the shared drive\n")
    else:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return bad


def _finetune(src: str, data: str, out: str) -> int:
    from pipeline import commands  # what launch/finetune.py runs

    return commands.finetune(["--from", src, "--res", "32", f"run.dir={out}", f"data.path={data}"])


def _pretrain(src: str, data: str, out: str) -> int:
    from pipeline import commands  # what launch/pretrain.py runs: --from is the run a DINOv3 stage continues

    return commands.pretrain(["--config", "configs/pretrain/dinov3_demo.yaml", "--from", src, *SHRINK,
                              f"run.dir={out}", f"data.path={data}"])


LAUNCHERS = {
    "evaluate": lambda src, data, out: launcher("evaluate").main(["--from", src, "--data", data, "--no-mlflow"]),
    "embed": lambda src, data, out: launcher("embed").main(["--from", src, "--data", data, "--out", out]),
    "export_weights": lambda src, data, out: launcher("export_weights").main([src, "--format", "onnx", "--out", out]),
    "finetune": _finetune,
    "pretrain": _pretrain,
}


@pytest.mark.parametrize("kind", ["other_width", "not_weights", "truncated"])
@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_a_bad_source_is_one_line_naming_it_and_exit_1(sources, data, tmp_path, capsys, name, kind):
    bad = bad_source(kind, sources("run-dinov3").path, tmp_path)
    assert LAUNCHERS[name](str(bad), str(data), str(tmp_path / "out")) == 1
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith(("error", "Traceback"))]  # (and the launchers' says)
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(bad) in lines[0], err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- export_weights replaces nothing

def test_export_weights_replaces_only_what_it_wrote_unless_forced(sources, tmp_path, capsys):
    export = launcher("export_weights").main
    run = tmp_path / "run"
    shutil.copytree(sources("run-supervised").path, run)
    before = (run / "model.safetensors").read_bytes()
    # The run's own export (its trainer's): kept, one line saying how to replace it.
    assert export([str(run)]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors exists (the run's own export" in err and "--force" in err, err
    assert (run / "model.safetensors").read_bytes() == before
    # Neither a file nor an export folder that is there already; --force replaces them.
    (tmp_path / "mine.safetensors").write_text("mine")
    assert export([str(run / "model.safetensors"), "--out", str(tmp_path / "mine.safetensors")]) == 1
    assert (tmp_path / "mine.safetensors").read_text() == "mine"
    assert export([str(run / "model.safetensors"), "--out", str(tmp_path / "mine.safetensors"), "--force"]) == 0
    assert export([str(run), "--format", "timm", "--out", str(tmp_path / "timm")]) == 0
    assert export([str(run), "--format", "timm", "--out", str(tmp_path / "timm")]) == 1
    assert "holds an export already" in capsys.readouterr().err
    assert export([str(run), "--format", "timm", "--out", str(tmp_path / "timm"), "--force"]) == 0
    # Its errors name the source as it was given: it has no --from.
    assert export([str(tmp_path / "missing"), "--format", "onnx"]) == 1
    err = capsys.readouterr().err
    assert "missing" in err and "--from" not in err, err


def test_debug_gives_the_traceback_instead_of_the_line(sources, data, tmp_path, monkeypatch):
    from pipeline.errors import DEBUG_ENV
    from pipeline.model.weights import WeightsError

    bad = bad_source("not_weights", sources("run-dinov3").path, tmp_path)
    # setenv first: monkeypatch then restores the variable as it was before the test (unset), although --debug
    # sets it in os.environ itself; a delenv of an unset variable records nothing and left it set for later tests.
    monkeypatch.setenv(DEBUG_ENV, "")
    monkeypatch.delenv(DEBUG_ENV)
    with pytest.raises(WeightsError, match="is not a weights file"):  # raised: Python prints its traceback
        launcher("embed").main(["--from", str(bad), "--data", str(data), "--out", str(tmp_path / "o"), "--debug"])
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(WeightsError, match="is not a weights file"):
        launcher("evaluate").main(["--from", str(bad), "--data", str(data), "--no-mlflow"])


@pytest.mark.slow  # one subprocess: DeepSpeed's launcher and two ranks
def test_embed_on_two_ranks_under_deepspeeds_launcher_writes_what_one_rank_writes(sources, data, tmp_path):
    """The launcher the docs name for N ranks appends --local_rank=N; the two ranks write each part once, the
    same rows as one rank in this process (a DINOv3 run: the recipe the registry read-back is newest for)."""
    import subprocess

    import pandas as pd

    from tests.integration.runs import DEEPSPEED, env, free_port

    src = sources("run-dinov3")
    args = ["--from", str(src.path), "--data", str(data), "--workers", "0", "--batch-size", "8"]
    assert launcher("embed").main([*args, "--out", str(tmp_path / "one")]) == 0
    out = subprocess.run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "launch/embed.py", *args,
                          "--out", str(tmp_path / "two")], cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    one, two = (pd.read_parquet(tmp_path / n).sort_values("key").reset_index(drop=True) for n in ("one", "two"))
    assert len(one) == 48 and list(one.key) == list(two.key)
    for column in ("cls", "mean_patch"):
        torch.testing.assert_close(torch.tensor(list(one[column])), torch.tensor(list(two[column])), atol=1e-5, rtol=0)


@pytest.mark.slow  # two subprocesses of two ranks each: 100 s niced beside a training run
def test_evaluate_on_two_ranks_under_torchrun_and_deepspeed_gives_what_one_rank_gives(sources, data, tmp_path):
    """launch/evaluate.py as docs/evaluation.md runs it on N ranks, under each launcher it names (srun: the cluster
    test): every figure of two ranks equals one rank's, bit for bit (each image's features computed once and
    gathered in the set's order; the k-NN and the probe then run on the same tensors)."""
    import json
    import subprocess

    from tests.integration.runs import DEEPSPEED, TORCHRUN, env, free_port

    src = sources("run-dinov2")
    args = ["--from", str(src.path), "--data", str(data), "--no-mlflow", "--batch-size", "8"]
    assert launcher("evaluate").main([*args, "--json", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())[0]["metrics"]
    for name, prefix in (("torchrun", [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port())]),
                         ("deepspeed", [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port())])):
        out = subprocess.run([*prefix, "launch/evaluate.py", *args, "--json", str(tmp_path / f"{name}.json")],
                             cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, name + out.stdout[-3000:] + out.stderr[-3000:]
        two = json.loads((tmp_path / f"{name}.json").read_text())[0]["metrics"]
        assert two == one, (name, two, one)


def test_a_release_file_is_read_with_its_authors_normalisation_unless_told(sources, data, tmp_path, capsys):
    """A file of another layout without a config.yaml beside it: ImageNet's mean and std (what Meta's and timm's
    DINO files were trained with), not our runs' 0.5; --mean/--std replace it; a run, or a config.yaml beside
    the file, keeps its own data.*."""
    import json

    import pyarrow.parquet as pq

    from pipeline.data.multicrop import IMAGENET_MEAN, IMAGENET_STD
    from pipeline.run.backbone import load_backbone

    for layout in FOREIGN:
        got = load_backbone(sources(f"file-{layout}").path)
        if got.config is None:  # Meta's DINOv2 and DINOv3 files, timm's DINOv3: they say their whole architecture
            assert (got.data.mean, got.data.std) == (IMAGENET_MEAN, IMAGENET_STD), layout
        else:
            assert got.data == got.config.data, layout
    run = load_backbone(sources("run-supervised").path)
    assert run.data == run.config.data and run.data.mean != IMAGENET_MEAN

    src = str(sources("file-meta_dinov2").path)

    def cls(*flags: str) -> torch.Tensor:
        out = tmp_path / f"emb{len(list(tmp_path.glob('emb*')))}"
        code = launcher("embed").main(["--from", src, "--data", str(data), "--out", str(out), "--workers", "0",
                                       "--splits", "val", *flags])
        assert code == 0, capsys.readouterr().err
        rows = pq.read_table(sorted(out.rglob("*.parquet"))).to_pandas().sort_values("key")
        return torch.tensor(list(rows.cls))

    imagenet = [*map(str, IMAGENET_MEAN)], [*map(str, IMAGENET_STD)]
    default = cls()
    assert torch.equal(default, cls("--mean", *imagenet[0], "--std", *imagenet[1]))
    assert not torch.allclose(default, cls("--mean", "0.5", "0.5", "0.5", "--std", "0.5", "0.5", "0.5"))
    # The timm export of a release file tells timm's transforms the same normalisation.
    assert launcher("export_weights").main([src, "--format", "timm", "--out", str(tmp_path / "timm")]) == 0
    config = json.loads((tmp_path / "timm" / "config.json").read_text())["pretrained_cfg"]
    assert (tuple(config["mean"]), tuple(config["std"])) == (IMAGENET_MEAN, IMAGENET_STD)
