import subprocess
import sys

import pytest

from pipeline.config import Config, ConfigError, load_config, save_config
from pipeline.typed_yaml import describe


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "model:\n  variant: vit_s16\n  img_size: [224, 320]\ntrain:\n  lr: 0.001\n")
    cfg = load_config(path, ["train.lr=3e-4", "deepspeed.zero_stage=3", "data.scale=[0.5, 1.0]"])
    assert cfg.model.variant == "vit_s16" and cfg.model.img_size == (224, 320)
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.deepspeed.zero_stage == 3 and cfg.data.scale == (0.5, 1.0)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["model.img_size=[96, 128]", "train.layer_decay=0.75", "tracking.run_name=x"])
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


@pytest.mark.parametrize("text,overrides,message", [
    ("train:\n  lrr: 1\n", [], "unknown key 'train.lrr'; valid keys here: steps"),
    ("modle: {}\n", [], "unknown key 'modle'"),
    ("", ["train.steps=ten"], "key 'train.steps' expects int, got 'ten'"),
    ("", ["train.optimizer=lamb"], "key 'train.optimizer' expects 'adamw' | 'adam' | 'sgd'"),
    ("", ["model.qkv_bias=1"], "key 'model.qkv_bias' expects bool"),
    ("", ["model.img_size=[1, 2, 3]"], "key 'model.img_size' expects int | [int, int]"),
    ("train: 5\n", [], "section 'train' must be a mapping"),
    ("", ["train.lr"], "expected key=value"),
])
def test_errors_name_the_key_and_what_was_expected(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), overrides)
    assert message in str(e.value)
    assert str(tmp_path) in str(e.value) or "override" in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does-not-exist.yaml' does not exist"):
        load_config(tmp_path / "does-not-exist.yaml")


def test_every_field_is_documented():
    rows = describe(Config)
    undocumented = [key for key, _, doc in rows if not doc]
    assert not undocumented and len(rows) > 40


def test_launcher_prints_one_line_not_a_traceback(tmp_path):
    path = write(tmp_path, "train:\n  lrr: 1\n")
    code = "import sys; from pipeline.config import load_or_exit; load_or_exit(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {path}: unknown key 'train.lrr'; valid keys here: "
                                                 + ", ".join(f.split(".")[1] for f, _, _ in describe(Config)
                                                             if f.startswith("train."))]


def test_yaml_exponent_without_dot_is_a_number(tmp_path):
    # PyYAML (YAML 1.1) reads 3e-4 as a string; users mean a number.
    cfg = load_config(write(tmp_path, "train:\n  lr: 3e-4\n  min_lr: 1e-6\n"))
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.train.min_lr == pytest.approx(1e-6)


@pytest.mark.parametrize("override,message", [
    ("deepspeed.zero_stage=4", "key 'deepspeed.zero_stage' must be 0, 1, 2 or 3, got 4"),
    ("deepspeed.offload_params=true", "'deepspeed.offload_params' must be false unless deepspeed.zero_stage is 3"),
    ("train.warmup_steps=-1", "'train.warmup_steps' must be >= 0, got -1"),
])
def test_values_out_of_range_are_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
