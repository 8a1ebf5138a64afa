#!/usr/bin/env python
"""Write WebDataset shards and a dataset.json that the train stream and eval pass read.

    python launch/make_shards.py --source digits --out data/digits
    python launch/make_shards.py --source digits --no-labels --out data/digits-unlabelled   # images only
    python launch/make_shards.py --source digits --dtype uint16 --out data/digits16   # 1-channel 16-bit arrays
    python launch/make_shards.py --source digits:shifted --out data/digits-shifted   # inverted, turned 90 degrees
    python launch/make_shards.py --source fashion-mnist --out data/fmnist   # Debian's dataset-fashion-mnist package
    python launch/make_shards.py --source idx:/data/kmnist --classes 0,1,2 --out data/kmnist3   # IDX files, 3 classes
    python launch/make_shards.py --source folder:/data/imagenet --out data/imagenet --workers 8 --resize 256
    python launch/make_shards.py --source synthetic --num-samples 5000 --num-classes 10 --size 64 --out data/synth
    python launch/make_shards.py --source 'shards:/data/laion/{00000..00099}.tar' --label-key json:label --out /data/laion
    python launch/make_shards.py --source folder:/data/imagenet --out s3://bucket/imagenet   # straight to a bucket
    python launch/make_shards.py --source 'shards:s3://bucket/laion/{00000..00099}.tar' --out s3://bucket/laion

`folder:PATH`, in each of its forms (every image's path under PATH is recorded with it: KEY.src):
  PATH/CLASS/*.jpg                      labelled; --val-fraction of each class held out (stratified, seeded)
  PATH/train/CLASS/*, PATH/val/CLASS/*  labelled, the two splits as they are (no val/: train only)
  PATH/*.jpg                            no sub-folders: label-free (MAE, DINO); --val-fraction held out, 0 for
                                        a train split alone (judged by eval.sets, docs/evaluation.md)
  PATH/train/*.jpg, PATH/val/*.jpg      label-free, the two splits as they are
Besides JPEG/PNG/...: 16-bit PNG, TIFF (pages and bands as channels), .npy (H x W x C) and DICOM (its rescale
applied) are stored losslessly as KEY.npy in their own dtype and channel count, and dataset.json gets their
channels, dtype and per-channel mean/std (docs/data.md, Pixels as they are).
`idx:DIR`: the IDX files of MNIST, Fashion-MNIST, KMNIST or EMNIST (train-images-idx3-ubyte[.gz],
train-labels-idx1-ubyte[.gz], t10k-...), the official split as train and val, each image a one-channel 8-bit
array; `fashion-mnist` is idx: on /usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist).
--classes keeps some classes of any labelled source, relabelled 0..k-1 in the order given.
--no-labels writes any form without its labels. `shards:PATTERN` describes shards
written by others (img2dataset, timm) in --out/dataset.json without copying them. An s3://bucket/prefix
--out gets each shard as it is complete and dataset.json last (boto3's credentials and endpoint
variables: docs/data.md, Object storage).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.data import DataError  # noqa: E402
from pipeline.data.idx import FASHION_MNIST_DIR, fashion_mnist_source, idx_source  # noqa: E402
from pipeline.data.shards import (  # noqa: E402
    digits_source,
    folder_source,
    index_shards,
    keep_train_fraction,
    synthetic_source,
    write_dataset,
)
from pipeline.data.sources import DIGIT_STYLES, keep_classes, without_labels  # noqa: E402


def parse_size(text: str) -> int | tuple[int, int]:
    if "x" in text:
        h, w = text.lower().split("x")
        return (int(h), int(w))
    return int(text)


def parse_bytes(text: str) -> int:
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    text = text.strip().lower().rstrip("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True,
                   help="folder:PATH | idx:DIR | fashion-mnist | digits[:shifted] | synthetic | shards:PATTERN "
                        "(brace range or glob)")
    p.add_argument("--out", required=True, help="output folder, or s3://bucket/prefix: shards and dataset.json")
    p.add_argument("--max-samples-per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--max-bytes-per-shard", type=parse_bytes, default=None,
                   help="also cap each shard's size, e.g. 500M")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="held-out fraction per class (default: 0.2 for digits/synthetic, 0.1 for a folder "
                        "without val/)")
    p.add_argument("--train-fraction", type=float, default=None,
                   help="keep this fraction of each class of the train split, the validation split whole "
                        "(a few-label fine-tune: 0.1 for 10%% of the labels)")
    p.add_argument("--classes", default=None,
                   help="keep these classes only, comma-separated labels or class names, relabelled 0..k-1 in "
                        "this order (e.g. 0,1,2,3,4: Fashion-MNIST's T-shirt/top to Coat)")
    p.add_argument("--no-labels", action="store_true",
                   help="write the images only, no labels (the same images and splits): the shards of a "
                        "self-supervised run, judged on the labelled ones apart (eval.sets, docs/evaluation.md)")
    p.add_argument("--seed", type=int, default=0, help="split and shuffle seed (default 0)")
    p.add_argument("--workers", type=int, default=1, help="processes encoding images (default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace shards and dataset.json already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("folder")
    g.add_argument("--resize", type=int, default=None,
                   help="shrink the shorter side to this many pixels (re-encodes as JPEG)")
    g.add_argument("--quality", type=int, default=None, help="JPEG quality when re-encoding (default 95; synthetic 90)")
    g = p.add_argument_group("digits / synthetic")
    g.add_argument("--size", type=parse_size, default=None, help="image size, 32 or 64x48 (digits 32, synthetic 64)")
    g.add_argument("--dtype", choices=("uint8", "uint16"), default="uint8",
                   help="digits: uint16 writes single-channel 16-bit arrays (the 17 grey levels x 65535/16) instead "
                        "of 8-bit RGB PNGs")
    g.add_argument("--num-samples", type=int, default=1000, help="synthetic: samples in all (default 1000)")
    g.add_argument("--num-classes", type=int, default=10, help="synthetic: classes (default 10)")
    g = p.add_argument_group("shards written by others")
    g.add_argument("--label-key", default="cls", help="shards: where the label is: cls | txt | json:FIELD")
    g.add_argument("--split", default="train", help="shards: split name for --source (default train)")
    g.add_argument("--val-shards", default=None, help="shards: pattern of the validation shards")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kind, _, arg = args.source.partition(":")
    try:
        if not 0 <= (args.val_fraction or 0) < 1:
            raise DataError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
        if kind == "shards":
            if args.train_fraction is not None or args.classes is not None:
                raise DataError("--train-fraction and --classes write a subset; shards:PATTERN only indexes shards "
                                "in place")
            if args.no_labels:
                raise DataError("--no-labels writes new shards; shards:PATTERN only indexes shards in place "
                                "(a run that needs no labels reads them whatever they hold)")
            splits = {args.split: arg}
            if args.val_shards:
                splits["val"] = args.val_shards
            index_shards(splits, args.out, args.label_key, progress=not args.no_progress)
            return 0
        if kind == "digits":
            size = args.size or 32
            if not isinstance(size, int):
                raise DataError("--size for digits must be one number (square images)")
            vf = 0.2 if args.val_fraction is None else args.val_fraction
            if arg and arg not in DIGIT_STYLES:
                raise DataError(f"--source digits:{arg}: the style is one of {', '.join(DIGIT_STYLES)}")
            source = digits_source(size, vf, args.seed, args.dtype, arg or None)
        elif kind == "synthetic":
            vf = 0.2 if args.val_fraction is None else args.val_fraction
            source = synthetic_source(args.num_samples, args.num_classes, args.size or 64, vf, args.seed,
                                      args.quality or 90)
        elif kind == "folder":
            if not arg:
                raise DataError("--source folder:PATH needs a path")
            vf = 0.1 if args.val_fraction is None else args.val_fraction
            source = folder_source(arg, vf, args.seed, args.resize, args.quality or 95)
        elif kind in ("idx", "fashion-mnist") and args.val_fraction is not None:
            raise DataError(f"--val-fraction: --source {kind} keeps the set's official split (t10k- as val)")
        elif kind == "idx":
            if not arg:
                raise DataError("--source idx:DIR needs the folder of the IDX files")
            source = idx_source(arg)
        elif kind == "fashion-mnist":
            source = fashion_mnist_source(arg or FASHION_MNIST_DIR)
        else:
            raise DataError(f"unknown --source '{args.source}'; expected folder:PATH, idx:DIR, fashion-mnist, "
                            f"digits, synthetic or shards:PATTERN")
        if args.classes is not None:
            source = keep_classes(source, args.classes.split(","))
        if args.train_fraction is not None:
            source = keep_train_fraction(source, args.train_fraction, args.seed)
        if args.no_labels:
            source = without_labels(source)
        write_dataset(source, args.out, args.max_samples_per_shard, args.max_bytes_per_shard, args.seed,
                      args.workers, args.overwrite, progress=not args.no_progress)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: completed shards are kept, no dataset.json was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
