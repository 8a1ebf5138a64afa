"""The cost each config's header states follows from the code and the config: the GFLOP per image is the
objective's `flops_per_image` for that config, the steps and batch are the config's, the total is steps x
batch x 3 x the per-image figure, the FLOP/s is the stated MFU of an H100's 989e12 dense bf16 peak, and the
GPU-hours, the hours on N GPUs, the seconds and the images per second follow from those, each within the
rounding the header prints. A header left stale by a change to the config or to a FLOP count fails here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.objectives import OBJECTIVES, load_config

ROOT = Path(__file__).resolve().parents[2]
H100_PEAK = 989e12  # dense bf16 FLOP/s, what every header's MFU is a fraction of
CONFIGS = sorted([*ROOT.glob("configs/pretrain/*.yaml"), *ROOT.glob("configs/finetune/*.yaml")])

NUM = r"\d[\d,]*(?:\.\d+)?"
SCI = r"\d+(?:\.\d+)?e\+?\d+"


def header(path: Path) -> str:
    """The comment lines before the first key, as one line (a figure may wrap onto the next comment line)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def costed(path: Path) -> bool:
    """Whether the header states a cost in figures (some fine-tune headers say it in words: "90 epochs of
    1.28M images")."""
    return "GFLOP per image" in header(path)


def value(text: str) -> float:
    return float(text.replace(",", ""))


def half_unit(text: str) -> float:
    """Half a unit of the last digit `text` shows: 685.6 -> 0.05, 3.95e+21 -> 5e18, 27,100 -> 50 (an
    integer's trailing zeros are taken as rounding)."""
    mantissa, _, exponent = text.replace(",", "").lower().partition("e")
    if "." in mantissa:
        unit = 10.0 ** -len(mantissa.split(".")[1])
    else:
        unit = 10.0 ** (len(mantissa) - len(mantissa.rstrip("0"))) if mantissa.strip("0") else 1.0
    return 0.5 * unit * 10.0 ** int(exponent or 0)


def shown(text: str, *candidates: float) -> bool:
    """Whether `text` is one of `candidates` as the header rounds it (the candidates: the same figure by the
    header's printed inputs and by the exact ones)."""
    return any(abs(value(text) - c) <= half_unit(text) * (1 + 1e-9) for c in candidates)


def one(pattern: str, text: str, what: str, path: Path) -> re.Match:
    found = list(re.finditer(pattern, text))
    assert len(found) == 1, f"{path.name}: {len(found)} matches for {what} ({pattern!r}) in its header"
    return found[0]


def flops_per_image(path: Path, text: str) -> float:
    """What the objective counts for this config. A supervised model's head needs the class count, which
    is the data set's: the header names it where it is not ImageNet-1k's 1,000."""
    classes = re.search(rf"({NUM}) classes", text)
    info = SimpleNamespace(num_classes=int(value(classes.group(1))) if classes else 1000, path=str(path))
    cfg = load_config(path)
    objective = OBJECTIVES[cfg.model.objective](cfg, info)
    if cfg.model.objective == "distill":  # its teacher: the run of configs/pretrain/<run dir's name>.yaml
        objective.found = run_backbone_on_meta(Path(cfg.distill.teacher).name)
    return objective.flops_per_image(objective.model_kwargs())


def run_backbone_on_meta(name: str):
    """The backbone the run of configs/pretrain/NAME.yaml exports, built on the meta device (shapes only)."""
    import torch

    from pipeline.model.dinov3 import build_backbone
    from pipeline.model.variants import model_kwargs_from_config
    from pipeline.objectives.backbone import Backbone

    cfg = load_config(ROOT / "configs" / "pretrain" / f"{name}.yaml")
    kwargs = {**model_kwargs_from_config(cfg.model, 0), "num_classes": 0}
    with torch.device("meta"):
        return Backbone(build_backbone(kwargs), kwargs, cfg.data, Path(name), None, cfg)


@dataclass(frozen=True)
class Cost:
    """A header's cost figures as printed, and the config's steps and batch."""

    path: Path
    text: str
    steps: int
    batch: int
    per_image: str  # GFLOP
    total: str  # FLOP
    rate: str  # FLOP/s of one GPU
    mfu: float

    def exact_total(self) -> float:
        return self.steps * self.batch * 3 * value(self.per_image) * 1e9

    def rates(self) -> tuple[float, float]:
        return value(self.rate), self.mfu * H100_PEAK

    def gpu_hours(self) -> list[float]:
        """By the printed total and FLOP/s, and by the exact ones (the headers round either way)."""
        return [t / r / 3600 for t in (value(self.total), self.exact_total()) for r in self.rates()]


@cache
def cost(path: Path) -> Cost:
    text, cfg = header(path), load_config(path)
    return Cost(
        path,
        text,
        cfg.train.steps,
        cfg.train.global_batch_size,
        per_image=one(rf"({NUM}) GFLOP per image", text, "the GFLOP per image", path).group(1),
        total=one(rf"= ({SCI}) FLOP(?!/s)", text, "the total '= X FLOP'", path).group(1),
        rate=one(rf"({SCI}) FLOP/s", text, "the FLOP/s", path).group(1),
        mfu=value(one(rf"({NUM})% MFU", text, "the MFU", path).group(1)) / 100,
    )


COSTED = [p for p in CONFIGS if costed(p)]
IDS = [f"{p.parent.name}/{p.name}" for p in COSTED]


def test_every_costed_config_is_checked():
    # The tests below would pass on no configs at all: these recipes' headers state their cost in figures.
    names = {p.name for p in COSTED}
    assert {
        "dinov2_vitl14.yaml",
        "mae_vit_l16.yaml",
        "vit_b16_i21k.yaml",
        "vit_b16_384.yaml",
        "dinov3_vits16.yaml",
        "dinov3_vitb16.yaml",
        "dinov3_vitl16.yaml",
        "dinov3_vitl16_gram.yaml",
        "dinov3_vitl16_highres.yaml",
    } <= names


@pytest.mark.parametrize("path", COSTED, ids=IDS)
def test_gflop_per_image_is_the_objectives(path: Path):
    c = cost(path)
    computed = flops_per_image(path, c.text) / 1e9
    assert shown(c.per_image, computed), (
        f"{path.name}: header {c.per_image} GFLOP per image, the code {computed:.4f}"
    )


@pytest.mark.parametrize("path", COSTED, ids=IDS)
def test_total_is_steps_x_batch_x_3_x_per_image(path: Path):
    c = cost(path)
    run = one(rf"({NUM}) steps x ({NUM})", c.text, "'N steps x B'", path)
    assert (value(run.group(1)), value(run.group(2))) == (c.steps, c.batch), (
        f"{path.name}: header {run.group(1)} steps x {run.group(2)}, the config {c.steps:,} x {c.batch:,}"
    )
    if images := re.search(rf"= ({NUM})([MB]) images", c.text):
        scale = {"M": 1e6, "B": 1e9}[images.group(2)]
        assert shown(images.group(1), c.steps * c.batch / scale), f"{path.name}: {images.group(0)}"
    product = one(rf"x 3 x ({NUM})e9", c.text, "'x 3 x <GFLOP>e9'", path).group(1)
    assert value(product) == value(c.per_image), (
        f"{path.name}: the total multiplies {product}e9, not {c.per_image}e9"
    )
    assert shown(c.total, c.exact_total()), (
        f"{path.name}: total {c.total} FLOP, the product {c.exact_total():.4g}"
    )


@pytest.mark.parametrize("path", COSTED, ids=IDS)
def test_times_follow_at_the_stated_mfu_of_an_h100(path: Path):
    c = cost(path)
    assert shown(c.rate, c.mfu * H100_PEAK), (
        f"{path.name}: {c.rate} FLOP/s is not {c.mfu:.0%} of {H100_PEAK:g}"
    )
    hours = c.gpu_hours()
    said = f"the figures give {hours[0]:,.2f} GPU-hours"
    if stated := re.search(rf"about ({NUM}) GPU-hours", c.text):
        assert shown(stated.group(1), *hours), f"{path.name}: about {stated.group(1)} GPU-hours; {said}"
    for amount, unit, gpus in re.findall(rf"({NUM}) (h|min) on (\d+)\b", c.text):
        per = 60 if unit == "min" else 1
        assert shown(amount, *(h * per / int(gpus) for h in hours)), (
            f"{path.name}: {amount} {unit} on {gpus}; {said}"
        )
    for gpus, seconds in re.findall(rf"/ \((\d+) x {SCI}\) = ({NUM}) s\b", c.text):
        assert shown(seconds, *(h * 3600 / int(gpus) for h in hours)), (
            f"{path.name}: {seconds} s on {gpus}; {said}"
        )
    if speed := re.search(rf"~({NUM}) img/s", c.text):
        per_gpu = [r / (3 * value(c.per_image) * 1e9) for r in c.rates()]
        assert shown(speed.group(1), *per_gpu), (
            f"{path.name}: ~{speed.group(1)} img/s, the figures give {per_gpu}"
        )
