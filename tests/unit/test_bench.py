"""The model/engine/e2e benchmarks (benchmarks, launch/bench.py): tiny runs that finish in seconds,
the figures they return, and that the plain-loop baseline does the same work as DeepSpeed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import common, model

ROOT = Path(__file__).resolve().parents[2]
TINY = common.BenchSpec("vit_ti16", res=32, batch=2, dtype="bf16", num_classes=10, steps=1, windows=2, warmup=1)


@pytest.fixture(autouse=True)
def _restore_threads():
    """The benchmarks set torch's thread count (--threads); other tests get theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _positive(d: dict, *keys: str) -> None:
    for k in keys:
        assert d[k] > 0, (k, d[k])


def test_interleaved_takes_turns_after_warmup():
    calls: list[str] = []
    contenders = {name: (lambda n=name: calls.append(n)) for name in ("a", "b", "c")}
    times = common.interleaved(contenders, steps=2, windows=3, warmup=1, device=torch.device("cpu"))
    assert calls[:3] == ["a", "b", "c"]  # warm-up
    assert calls[3:] == ["a", "a", "b", "b", "c", "c"] * 3  # windows in turns
    for clock in (times.wall, times.cpu):
        assert {k: len(v) for k, v in clock.items()} == {"a": 3, "b": 3, "c": 3}
        assert all(t >= 0 for v in clock.values() for t in v)


def test_model_bench_returns_ours_timm_and_ratio():
    torch.set_num_threads(1)
    f = model.run(TINY, peak=1e12, log=lambda *_: None)
    for name in ("ours", "timm"):
        _positive(f[name], "img_s", "step_ms", "tflops", "mfu", "cpu_step_ms")
    assert f["ours_vs_timm"] > 0 and len(f["ours_vs_timm_windows"]) == TINY.windows
    assert f["ours_vs_timm_cpu"] > 0 and len(f["ours_vs_timm_cpu_windows"]) == TINY.windows
    assert f["gflops_per_image"] > 0 and f["seconds"] > 0
    assert model.rows(f)[0][0] == "ours"


def test_model_pair_has_identical_weights_and_outputs():
    ours, theirs = model.build_pair(TINY)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(x), ours.eval()(x), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_plain_step_bf16_keeps_fp32_master_weights():
    torch.manual_seed(0)
    spec = TINY
    ours, _ = model.build_pair(spec)
    images, targets = common.synthetic_batch(spec, torch.device("cpu"))
    step = common.PlainStep(ours, spec, images, targets)
    assert all(p.dtype == torch.bfloat16 for p in step.model.parameters())
    losses = [step().item() for _ in range(3)]
    assert losses[-1] < losses[0]
    for p, m in zip(step.params, step.master_params):
        assert m.dtype == torch.float32 and torch.equal(p.detach(), m.detach().to(torch.bfloat16))


DIST_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, ".")
    torch.set_num_threads(1)
    from benchmarks import common, engine, gpu
    # The benchmarks' code in fp32 (benchmarks/gpu.py's SMOKE says why); the baseline check below in bf16.
    spec = common.BenchSpec("vit_ti16", res=32, batch=4, dtype="fp32", num_classes=10, steps=1, windows=2, warmup=1)
    out = {"engine": engine.run(spec, (0, 1, 2, 3), check_finite=True, log=lambda *_: None)}
    # `bench gpu`'s code on the CPU, without the compiled arms (Inductor's C++ build takes minutes here). Its end
    # to end part is `bench e2e`'s code (benchmarks.e2e.run, 48 images, one worker) with the decode on the CPU
    # and the nvjpeg path's code run on the CPU device (workers draw crops, the step decodes): the e2e figures
    # the tests read (two e2e.run calls of their own, at the same sizes, until the suite's time was cut).
    out["gpu"] = gpu.run(smoke=True, arms=[gpu.Arm("plain", False), gpu.Arm("zero1", False, True, 2),
                                           gpu.Arm("zero1", False, overrides=(gpu.DEEPSPEED_CHECKS,), label="checks")],
                         correctness_steps=4, workers=1, log=lambda *_: None)
    # The baseline does DeepSpeed's work: same weights, same bf16 + fp32-master AdamW, same clipping.
    spec = common.BenchSpec("vit_ti16", res=32, batch=4, dtype="bf16", num_classes=10)
    x, y = common.synthetic_batch(spec, torch.device("cpu"))
    plain = engine.build_plain(spec, x, y)
    ds = engine.build_engine(spec, 1)
    out["plain_losses"] = [plain().item() for _ in range(3)]
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(ds(x).float(), y)
        ds.backward(loss)
        ds.step()
        losses.append(loss.item())
    out["zero1_losses"] = losses
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def dist_figures() -> dict:
    """engine and e2e join a process group: run them in a child process (the test process stays clean)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", DIST_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_engine_bench_has_every_stage_with_check_finite(dist_figures):
    from benchmarks import engine

    f = dist_figures["engine"]
    _positive(f["plain"], "img_s", "step_ms")
    for stage in (0, 1, 2, 3):
        z = f[f"zero{stage}"]
        _positive(z, "img_s", "step_ms", "vs_plain", "vs_plain_cpu", "cpu_step_ms")
        _positive(z["check_finite"], "img_s", "step_ms", "vs_plain", "vs_off", "vs_off_cpu")
        assert len(z["vs_plain_windows"]) == 2
    assert len(engine.rows(f)) == 5


@pytest.mark.slow
@pytest.mark.parametrize("decode", ["cpu", "cuda"])
def test_e2e_bench_compares_loader_with_synthetic(dist_figures, decode):
    f = dist_figures["gpu"]["e2e"][decode]  # benchmarks.e2e.run's figures (and the CPU it took)
    _positive(f["loader"], "img_s", "step_ms")
    _positive(f["synthetic"], "img_s", "step_ms")
    assert f["e2e_vs_synthetic"] > 0 and 0 <= f["loader"]["data_wait"] <= 1
    assert f["zero_stage"] == 1 and f["workers"] == 1


@pytest.mark.slow
def test_plain_loop_matches_deepspeed_zero1_bf16(dist_figures):
    # The overhead ratio compares equal work (DeepSpeed's bf16 + fp32 master AdamW + clipping): the same
    # losses up to rounding (DeepSpeed sums the gradient norm over its flat buffer, in another order).
    # The first loss is computed before any update: equal bit for bit. After an update the two differ by
    # bf16 roundings of the weights (2^-8 relative): within bf16's epsilon, 2^-7 (seen on an AMD EPYC:
    # 0.38% at the third loss; a 1e-3 bound was tighter than bf16 can represent).
    plain, zero1 = dist_figures["plain_losses"], dist_figures["zero1_losses"]
    assert plain[0] == zero1[0] and plain[-1] < plain[0]
    torch.testing.assert_close(torch.tensor(plain), torch.tensor(zero1), rtol=2**-7, atol=0)


@pytest.mark.slow
def test_gpu_bench_code_runs_on_cpu_and_reports_every_part(dist_figures):
    from benchmarks import gpu

    f = dist_figures["gpu"]
    (model,) = f["training"].values()
    arms = model["arms"]
    assert list(arms) == ["plain eager", "zero1 eager ckpt", "zero1 eager checks"]
    assert arms["zero1 eager ckpt"]["batch"] == 2 * arms["plain eager"]["batch"] == 2 * model["batch"]
    for r in arms.values():
        _positive(r, "img_s", "step_ms")
    # The fastest arm of each loop at the trainer's settings is profiled (not one with overrides of its own).
    assert f["profile"]["arm"] == "zero1 eager ckpt" and f["profile"]["top"]
    assert f["profile_plain"]["arm"] == "plain eager" and f["profile_plain"]["top"]
    for p in (f["profile"], f["profile_plain"]):
        _positive(p, "kernels_per_step", "host_syncs_per_step")  # on the CPU: ops, and tensor reads
    for decode in ("cpu", "cuda"):
        _positive(f["e2e"][decode], "e2e_vs_synthetic", "cores_to_keep_up")
    c = f["correctness"]
    assert c["bf16_vs_fp32"]["steps"] == 4 and 0 <= c["bf16_vs_fp32"]["max_rel_gap_smoothed"] < 0.5
    assert c["nvjpeg_vs_pil"]["max_abs_diff"] == 0  # decode_jpeg on the CPU is libjpeg, as PIL
    assert len(gpu.rows(f)) == 3


def test_the_deepspeed_checks_arm_turns_deepspeeds_bf16_check_on_and_the_default_arms_off():
    """The arm's override reaches DeepSpeed's config under the key DeepSpeed reads; the default arms run as the
    trainer's default does, without it (docs/performance.md, Host reads)."""
    from benchmarks import gpu
    from pipeline.config import load_config
    from pipeline.derived import deepspeed_config

    (arm,) = [a for a in gpu.ARMS if a.label == "deepspeed-checks"]
    assert arm.name == "zero1 compiled deepspeed-checks"
    cfg = load_config(None, [*arm.overrides, "deepspeed.bf16=true"])
    assert deepspeed_config(cfg, world_size=1)["bf16"]["check_grad_overflow"] is True
    default = load_config(None, ["deepspeed.bf16=true"])
    assert deepspeed_config(default, world_size=1)["bf16"]["check_grad_overflow"] is False


def test_the_new_option_arms_reach_the_run_config_and_are_chosen_by_name():
    """The matmul patch embedding and max-autotune arms set the config keys the trainer reads; --arms takes
    the autotune arm by name (it is not a default arm: minutes of autotuning) and refuses a name it lacks."""
    from benchmarks import gpu
    from pipeline.config import load_config

    (patch,) = [a for a in gpu.ARMS if a.label == "matmul-patch"]
    (tuned,) = gpu.AUTOTUNE_ARMS
    cfg = load_config(None, list(tuned.overrides))
    assert cfg.model.patch_embed_impl == "matmul" and cfg.train.compile_mode == "max-autotune-no-cudagraphs"
    assert load_config(None, list(patch.overrides)).train.compile_mode == "default"
    assert gpu.select_arms(None) is None and gpu.select_arms(tuned.name) == [tuned]
    with pytest.raises(ValueError, match="expected some of: plain eager"):
        gpu.select_arms("zero1 fastest")


def test_gpu_e2e_times_the_profiled_arm_or_zero1_compiled_at_the_first_models_batch():
    from benchmarks import gpu

    b16 = common.BenchSpec("vit_b16", 224, 0, "bf16", steps=10, windows=3, warmup=3)
    profiled = (replace(b16, batch=256), gpu.Arm("zero1", True, grad_ckpt=True, batch_scale=2), 1000.0)
    s = gpu.e2e_setting(profiled, b16, smoke=False, first_model_batch=lambda: pytest.fail("no batch search"))
    assert (s.variant, s.res, s.batch, s.compile, s.grad_ckpt) == ("vit_b16", 224, 512, True, True)
    alone = gpu.e2e_setting(None, b16, smoke=False, first_model_batch=lambda: 384)  # --parts e2e
    assert (alone.batch, alone.compile, alone.grad_ckpt) == (384, True, False)
    assert not gpu.e2e_setting(None, b16, smoke=True, first_model_batch=lambda: 8).compile
    with pytest.raises(ValueError, match="--parts: nvjpeg is not among training,e2e,correctness"):
        gpu.run(smoke=True, parts=["e2e", "nvjpeg"])


def _launch_bench():
    spec = importlib.util.spec_from_file_location("launch_bench", ROOT / "launch" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_flags_override_the_preset_and_all_parses():
    bench = _launch_bench()
    p = bench.build_parser()
    args = p.parse_args(["all"])  # every benchmark's flags in one parser, no clashes
    assert args.batch is None and args.batch_size == 64
    args = p.parse_args(["model", "--variant", "vit_s16", "--res", "96", "--batch", "4", "--dtype", "fp32",
                         "--grad-ckpt", "--steps", "2", "--threads", "1"])
    from benchmarks.cli import _specs

    (spec,) = _specs(args)
    assert (spec.variant, spec.res, spec.batch, spec.dtype, spec.grad_ckpt, spec.compile, spec.steps) == \
        ("vit_s16", 96, 4, "fp32", True, False, 2)
    gpu = _specs(p.parse_args(["model", "--preset", "gpu", "--threads", "1"]))
    assert [(s.variant, s.batch, s.dtype) for s in gpu] == [("vit_b16", 256, "bf16"), ("vit_l16", 64, "bf16")]


def test_cli_model_runs_and_prints_a_table(capsys):
    bench = _launch_bench()
    code = bench.main(["--no-csv", "model", "--variant", "vit_ti16", "--res", "32", "--batch", "2", "--steps", "1",
                       "--windows", "1", "--warmup-steps", "0", "--threads", "1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "ours" in out and "timm" in out and "step time / timm" in out


@pytest.mark.slow
@pytest.mark.dist
def test_preemption_bench_runs_two_ranks_and_returns_the_agreement_cost(capsys):
    bench = _launch_bench()
    figures = bench.run_bench("preemption", bench.build_parser().parse_args(["preemption"]))
    assert figures["ranks"] == 2 and figures["calls"] == 2000
    assert 0 < figures["median_us"] <= figures["p90_us"] < 1e6  # an all-reduce of one int: well under a second
    assert "median us" in capsys.readouterr().out


def test_render_writes_the_newest_row_per_machine_and_the_committed_page_is_current(tmp_path, capsys):
    from benchmarks.render import DOCS_PAGE, render, render_page
    from benchmarks.results import CSV_COLUMNS, RESULTS_CSV

    rows = [dict(zip(CSV_COLUMNS, r)) for r in (
        ["2026-01-01T00:00:00", "cpu box", "2.0", "0.19", "python launch/bench.py model", "model",
         json.dumps({"ours": {"img_s": 1.0}})],
        ["2026-01-02T00:00:00", "cpu box", "2.0", "0.19", "python launch/bench.py model --batch 4", "model",
         json.dumps({"ours": {"img_s": 2.5, "mfu": None}, "windows": [1, 2]})],
        ["2026-01-03T00:00:00", "gpu box", "2.1", "0.19", "python launch/bench.py gpu", "gpu", "{}"],
        # A lease runs gpu's parts and dino's recipes as rows of their own: each subject's newest row is shown.
        ["2026-01-04T00:00:00", "gpu box", "2.1", "0.19", "python launch/bench.py gpu --parts correctness", "gpu",
         json.dumps({"parts": ["correctness"], "correctness": {"gap": 0.1}})],
        ["2026-01-04T00:00:00", "gpu box", "2.1", "0.19", "python launch/bench.py dino", "dino",
         json.dumps({"recipe": "dinov2", "variant": "vit_l14", "dino": {"mfu": 0.15}})],
        ["2026-01-05T00:00:00", "gpu box", "2.1", "0.19", "python launch/bench.py dino --dino-recipe dinov3", "dino",
         json.dumps({"recipe": "dinov3", "variant": "dinov3_vitl16", "dino": {"mfu": 0.12}})])]
    page = render(rows)
    assert "| `dino.mfu` | 0.15 |" in page and "| `dino.mfu` | 0.12 |" in page
    assert "| `correctness.gap` | 0.1 |" in page and "### gpu box: parts correctness" in page
    assert "| `ours.img_s` | 2.5 |" in page and "| `ours.img_s` | 1.0 |" not in page  # the newest row only
    assert "| `ours.mfu` | n/a |" in page and "| `windows` | [1, 2] |" in page
    assert "python launch/bench.py model --batch 4" in page and "(1 earlier row(s) in the CSV)" in page
    assert page.index("## model") < page.index("## gpu")
    assert render_page(tmp_path / "missing.csv", tmp_path / "page.md") == 1
    assert "does not exist" in capsys.readouterr().out
    # The committed page is what the committed CSV renders to: a hand edit or a stale page fails here.
    with open(RESULTS_CSV, newline="") as f:
        import csv

        assert DOCS_PAGE.read_text() == render(list(csv.DictReader(f))), "run: python launch/bench.py render"


@pytest.mark.slow  # times two DINOv2 steps: 5 s
def test_dino_bench_times_both_steps_and_its_flop_prediction_holds(capsys, monkeypatch):
    """`launch/bench.py dino` on a tiny backbone (a 4x4 grid, so that iBOT's blocks fit): both steps
    timed, and the FLOPs per image that the trainer's MFU uses (3 x DINOv2.flops_per_image with iBOT's
    expected masked patches, 3 x model_flops) within a few percent of what FlopCounterMode counts over a
    real step (this batch's seeded masks hold 9 patches where 9.6 are expected; KoLeo's products and the
    norms are not predicted). Without the iBOT term the prediction was 10% low at ViT-S/14."""
    from benchmarks import dino

    monkeypatch.setattr(dino, "device_peak_flops", lambda override=None: 1e9)  # MFU in (0.1, 10): 4 decimals
    bench = _launch_bench()
    args = bench.build_parser().parse_args(["dino", "--dino-variant", "vit_ti16", "--dino-res", "64",
                                            "--dino-local-res", "32", "--dino-local-crops", "2",
                                            "--dino-prototypes", "64", "--dino-batch", "2", "--dino-steps", "1",
                                            "--dino-windows", "1", "--dino-threads", "1", "--dino-profile"])
    f = bench.run_bench("dino", args)
    for name in ("dino", "supervised"):
        _positive(f[name], "step_ms", "img_s", "cpu_step_ms", "predicted_gflops_per_image", "measured_gflops_per_image")
    assert f["supervised"]["measured_vs_predicted"] == pytest.approx(1.0, abs=0.02)
    assert f["ibot_masked_patches"] > 0 and f["ibot_masked_patches_expected"] > 0
    # The patch heads also run on the padding rows of iBOT's fixed-size gather (pipeline/objectives/dino/
    # masked.py): FlopCounterMode counts them (student forward and backward, teacher forward: 4 x the head per
    # row); the prediction, MFU's numerator, counts the useful rows only.
    from types import SimpleNamespace

    from pipeline.model.dino_head import dino_head_flops
    from pipeline.objectives import OBJECTIVES
    from pipeline.objectives.dino.masked import gathered_per_image

    obj = OBJECTIVES["dinov2"](dino.recipe_config("vit_ti16", 64, 2, 32, 64, "dinov2"), SimpleNamespace(num_classes=0))
    kw = obj.model_kwargs()
    rows = gathered_per_image(kw, obj.d.mask_probability, obj.d.mask_ratio) - f["ibot_masked_patches"] / 2
    padding = 4 * rows * dino_head_flops(kw, kw["embed_dim"], 64) / 1e9
    d = f["dino"]
    assert (d["measured_gflops_per_image"] - padding) / d["predicted_gflops_per_image"] == pytest.approx(1.0, abs=0.03)
    assert f["flop_ratio_measured"] > 2
    for name in ("dino", "supervised"):  # MFU from the prediction (the trainer's numerator) over the peak;
        # 2% for the figures' rounding (GFLOP to 0.01: 0.9% of the supervised 0.56)
        assert f[name]["mfu"] == pytest.approx(f[name]["predicted_gflops_per_image"] * f[name]["img_s"], rel=0.02)
    assert f["profile"]["steps"] == 3 and f["profile"]["top"] and f["profile"]["kernels_per_step"] > 0
    assert "dinov2 step" in capsys.readouterr().out  # the recipe's name (--dino-recipe)


def test_merge_appends_only_the_rows_the_csv_lacks_and_refuses_another_format(tmp_path):
    """`launch/bench.py merge`: the rows that came back from a GPU machine join the CSV once, in their order."""
    import csv

    from benchmarks.results import CSV_COLUMNS, merge_results

    def write(path: Path, rows: list[list[str]], header: list[str] = CSV_COLUMNS) -> Path:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(rows)
        return path

    row = lambda day, bench: [f"2026-01-0{day}T00:00:00", "box", "2.0", "0.19", "python launch/bench.py x", bench,  # noqa: E731
                              json.dumps({"a": {"b": 1}, "s": "x,y"})]
    ours = write(tmp_path / "ours.csv", [row(1, "model")])
    theirs = write(tmp_path / "theirs.csv", [row(1, "model"), row(2, "gpu"), row(3, "e2e")])
    assert merge_results([theirs], ours) == 2
    assert merge_results([theirs, theirs], ours) == 0  # once
    with open(ours, newline="") as f:
        got = list(csv.reader(f))
    assert got[1:] == [row(1, "model"), row(2, "gpu"), row(3, "e2e")]
    bad = write(tmp_path / "bad.csv", [["x"]], header=["when"])
    with pytest.raises(ValueError, match="bad.csv: columns"):
        merge_results([bad], ours)
    fresh = tmp_path / "fresh.csv"  # a missing CSV gets the header first
    assert merge_results([theirs], fresh) == 3 and fresh.read_text().splitlines()[0] == ",".join(CSV_COLUMNS)


def test_gpu_bench_script_parts_are_commands_bench_py_accepts():
    """launch/gpu_bench.sh runs on a lent GPU with no second chance: every part's arguments parse here."""
    import re
    import shlex

    bench = _launch_bench()
    script = (ROOT / "launch/gpu_bench.sh").read_text()
    parts = re.findall(r"^\s*part (\S+) (\d+) (\d+) (.+)$", script, flags=re.M)
    assert len(parts) >= 10, parts  # the smoke parts and the GPU ones
    for name, _, _, args in parts:
        try:
            parsed = bench.build_parser().parse_args(shlex.split(args))
        except SystemExit as e:
            raise AssertionError(f"gpu_bench.sh part {name}: launch/bench.py {args} does not parse") from e
        if getattr(parsed, "arms", None):  # arm names are checked when the part starts: check them here
            from benchmarks import gpu

            gpu.select_arms(parsed.arms)


def test_offline_wheels_cover_what_deepspeed_and_webdataset_need_beyond_a_torch_image():
    """launch/offline_wheels.sh carries, for a GPU machine without PyPI, what DeepSpeed and webdataset need
    beyond what it takes as there; a new requirement of either (a version bump) fails here, named."""
    import importlib.metadata as md
    import re

    script = (ROOT / "launch/offline_wheels.sh").read_text()
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731  pip's name normalisation
    carried, taken = ({norm(p) for p in re.search(rf"{name}=\(([^)]*)\)", script).group(1).split()}
                      for name in ("PACKAGES", "PRESENT"))
    pinned = {norm(line.split("==")[0]) for line in (ROOT / "constraints.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    assert carried <= pinned, f"offline_wheels.sh carries packages constraints.txt does not pin: {carried - pinned}"
    needed, todo = set(), ["deepspeed", "webdataset"]
    while todo:  # the closure of their requirements (no extras) down to what is taken as there
        name = todo.pop()
        if name in needed or name in taken:
            continue
        needed.add(name)
        for req in md.requires(name) or []:
            if "extra ==" not in req:
                todo.append(norm(re.match(r"[A-Za-z0-9._-]+", req).group(0)))
    assert needed - carried == set(), f"needed on the GPU machine, neither carried nor taken as there: {needed - carried}"


@pytest.mark.slow  # two distillation objectives built and stepped: 7 s at load 13
def test_distill_bench_times_one_and_two_students_on_one_teacher_forward():
    """`launch/bench.py distill` at its CPU sizes, batch 2: both steps timed, the teacher run once per step with
    one student and with two, and two students predicted cheaper than two runs of one by the teacher's forward."""
    bench = _launch_bench()
    args = bench.build_parser().parse_args(["distill", "--distill-batch", "2", "--distill-steps", "1",
                                            "--distill-windows", "1"])
    f = bench.run_bench("distill", args)
    for name in ("one", "two"):
        _positive(f[name], "step_ms", "cpu_step_ms", "gflops_per_image")
    assert f["one"]["teacher_forwards"] == f["two"]["teacher_forwards"] == 2  # warm-up + 1 timed step each
    assert f["two_runs_of_one_ms"] == pytest.approx(2 * f["one"]["step_ms"], abs=0.1)
    one, two = f["one"]["gflops_per_image"], f["two"]["gflops_per_image"]
    assert one < two < 2 * one and f["flop_ratio"] == pytest.approx(two / (2 * one), abs=2e-3)


def test_the_quality_table_averages_the_seeds_of_the_newest_preset_and_judges_the_targets(tmp_path):
    """benchmarks/quality_render.py: a recipe's cell is the mean ± half the range of its seeds' newest rows measured
    with its newest preset (a row of an older preset is never averaged in); each target says met or not; the picture
    is drawn from the curves."""
    from benchmarks import quality_render
    from benchmarks.render import render
    from benchmarks.results import CSV_COLUMNS

    def row(date, **figures):
        return dict(zip(CSV_COLUMNS, [date, "cpu box", "2.0", "0.19", "python launch/bench.py quality", "quality",
                                      json.dumps({"budget": "cpu", **figures})]))

    rows = [row("2026-01-01", recipe="pixels", knn=0.846, linear=0.836, knn_1pct=0.70, linear_1pct=0.78),
            row("2026-01-01", recipe="supervised", seed=0, preset_sha="old", top1=0.50, steps=10, epochs=0.1),
            row("2026-01-02", recipe="supervised", seed=0, preset_sha="new", top1=0.910, steps=100, epochs=1.0,
                pretrain_s=600, curve=[[50, 300, 0.8], [100, 600, 0.85]], knn=0.86),
            row("2026-01-02", recipe="supervised", seed=1, preset_sha="new", top1=0.930, steps=100, epochs=1.0,
                pretrain_s=660),
            row("2026-01-02", recipe="scratch", seed=0, preset_sha="ft", ft10=0.80, ft100=0.90, steps=5),
            row("2026-01-02", recipe="scratch-patch", seed=0, preset_sha="fp", ft10=0.70, ft100=0.88, steps=5),
            row("2026-01-02T10", recipe="mae", seed=0, preset_sha="m", knn=0.6, ft10=0.72, steps=9,
                command="python launch/bench.py quality --recipes mae"),
            row("2026-01-02", recipe="dinov2", seed=0, preset_sha="d", knn=0.86, linear=0.85, ft10=0.84, steps=9),
            row("2026-01-02", recipe="dinov2", seed=0, preset_sha="a", knn=0.80, steps=9, ablation="no-ibot",
                overrides=["dino.ibot_loss_weight=0"]),
            row("2026-01-03", recipe="dinov2", seed=0, preset_sha="s", smoke=True, knn=0.1, steps=4)]
    page = render(rows)
    assert "| dinov2 (no-ibot) | 1 | 9 |  | 80.0 |" in page and "- dinov2 (no-ibot): `dino.ibot_loss_weight=0`" in page
    assert page.index("| dinov2 |") < page.index("| dinov2 (no-ibot) |") < page.index("| ViT from random weights |")
    assert "| supervised | 2 | 100 (1.0) | 10 min |" in page and "| 92.0 ± 1.0 |" in page  # not the old preset's 50
    assert "| raw pixels |  |  |  | 84.6 | 83.6 | 70.0 | 78.0 |" in page
    assert "| supervised ViT from scratch >= the 2-layer conv net | 92.0% | yes |" in page
    assert "| DINOv2 k-NN >= 85% | 86.0% | yes |" in page and "| DINOv2 linear >= 87% | 85.0% | no |" in page
    assert "| DINOv2 fine-tuned, 10% of the labels >= scratch + 3 | +4.0 points | yes |" in page
    # MAE's preset has the patchify stem: judged against the fine-tune from random weights with it, not the conv's
    assert "| MAE fine-tuned, 10% of the labels >= scratch + 3 | +2.0 points | no |" in page
    assert "| DINOv3 fine-tuned, 10% of the labels >= scratch + 3 | not measured | |" in page
    assert "### cpu budget (smoke" in page and "| [quality](#quality) |" in page  # smoke rows: a table apart
    # the budget's heading names the newest row's date and command (the pixels' row is the first in the file)
    assert "cpu box, 2026-01-02T10; the command of the newest row:\n\n```\npython launch/bench.py quality --recipes mae\n" in page
    assert f"]({quality_render.PICTURE})" in page
    assert quality_render.draw(rows, tmp_path / "q.png") and (tmp_path / "q.png").stat().st_size > 1000
    assert not quality_render.draw(rows[:2], tmp_path / "none.png")  # no curve: no picture, none promised
    assert f"]({quality_render.PICTURE})" not in render(rows[:2])


def test_each_fine_tune_has_a_baseline_of_its_own_architecture():
    """The scratch baselines bench.py quality runs: one per stem the self-supervised presets have, each the
    fine-tune config with that stem (its own: 'scratch'; the patchify of MAE's and DINOv3's presets: another)."""
    from benchmarks.quality import FINETUNE, RECIPES, preset_stem, scratch_name

    assert preset_stem(FINETUNE) == "conv" and scratch_name("conv") == "scratch"
    assert scratch_name(preset_stem(RECIPES["dinov2"].preset)) == "scratch"
    assert scratch_name(preset_stem(RECIPES["mae"].preset)) == "scratch-patch"
    assert scratch_name(preset_stem(RECIPES["dinov3"].preset)) == "scratch-patch"


def test_quality_refuses_bad_arguments_in_one_line_before_any_work(tmp_path):
    bench = _launch_bench()
    cases = {("--recipes", "supervised,byol"): "--recipes supervised,byol: expected a comma-separated list of",
             ("--stages", "pretrain,train"): "--stages pretrain,train: expected pretrain, probe, finetune",
             ("--set", "dino.koleo_loss_weight=0"): "--set and --ablation go together",
             ("--ablation", "../x", "--set", "a=1"): "letters, digits, - and _",
             ("--seeds", "0"): "--seeds must be at least 1",
             ("--first-seed", "-1"): "--first-seed at least 0"}
    for argv, message in cases.items():
        with pytest.raises(SystemExit, match=re.escape(message)):
            bench.main(["--csv", str(tmp_path / "q.csv"), "quality", "--data-dir", str(tmp_path / "data"), *argv])
    assert not (tmp_path / "data").exists() and not (tmp_path / "q.csv").exists()
