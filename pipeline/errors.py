"""One line and exit 1 for whatever goes wrong reading a source, in every launcher; the traceback on request.

    parser = argparse.ArgumentParser(...); add_launcher_arguments(parser)    # --debug (and DeepSpeed's --local_rank)
    return one_line_errors(lambda: body(args), source=args.source)          # evaluate, embed, export_weights
    with reading_source(f"--from {source}"): ...                             # finetune's and pretrain's reads

A user hands the launchers files of every kind: a run directory of another recipe, a file in no known layout, a
truncated download, a text file named .pth, weights of another width than the config. Our own readers say so in
one line (WeightsError, ConfigError, ...); a reader deep in a library (torch, safetensors, a model's constructor)
raises what it raises (TypeError, RuntimeError, KeyError). Either way the user gets one line naming the source,
and exit code 1; `--debug`, or DEBUG_ENV=1 in the environment (every rank of a launcher sees it), re-raises the
error with its traceback instead (docs/troubleshooting.md). Bottom layer: no torch, nothing of ours imported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

DEBUG_ENV = "VIT_PIPELINE_DEBUG"
HINT = f"--debug or {DEBUG_ENV}=1 for the traceback"


class SourceError(ValueError):
    """What went wrong reading a source, in one line that names it (the original error chained)."""


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """--debug, and the --local_rank=N that DeepSpeed's launcher appends (LOCAL_RANK in the environment says
    the same, which pipeline.dist reads), so that `deepspeed launch/X.py` runs as torchrun and srun do."""
    parser.add_argument("--debug", action="store_true",
                        help=f"on an error, its traceback instead of one line (as {DEBUG_ENV}=1)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def add_normalisation_arguments(parser: argparse.ArgumentParser) -> None:
    """--mean/--std of the commands that read a source's features: the normalisation, per channel, instead of
    the source run's data.mean/std (a release file's: ImageNet's, docs/evaluation.md)."""
    for name, what in (("mean", "mean"), ("std", "standard deviation")):
        parser.add_argument(f"--{name}", type=float, nargs="+", metavar="X",
                            help=f"normalisation {what} per channel (default: the source run's data.{name}; "
                                 f"a release file's: ImageNet's)")


def set_debug(args: argparse.Namespace) -> None:
    if getattr(args, "debug", False):
        os.environ[DEBUG_ENV] = "1"  # for this process's later readers, and the processes it starts


def one_line(e: BaseException, source: str | None = None) -> str:
    """The error as one line that names `source` (unless it already does), with the type of an error that is
    not one of ours (a library's) and where its traceback is."""
    text = " ".join(str(e).split()) or type(e).__name__
    ours = type(e).__module__.startswith("pipeline") or isinstance(e, (FileNotFoundError, PermissionError))
    if not ours:
        text = f"{type(e).__name__}: {text} ({HINT})"
    if source and source not in text and str(source).rsplit("/", 1)[-1] not in text:
        text = f"{source}: {text}"
    return text


@contextlib.contextmanager
def reading_source(source: str) -> Iterator[None]:
    """Within, an error that is not already one of ours becomes a SourceError naming `source` (the original
    chained), unless debugging: the training commands report SourceError as they report a bad weights file."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        if debugging() or (type(e).__module__.startswith("pipeline") and isinstance(e, ValueError)):
            raise
        raise SourceError(one_line(e, source)) from e


def one_line_errors(body: Callable[[], int], source: str | None) -> int:
    """`body()`'s exit code; an error is one line on stderr (naming `source`) and exit code 1, or its traceback
    when debugging. KeyboardInterrupt and SystemExit (argparse's exit 2) pass."""
    try:
        return body()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        if debugging():
            raise
        print(f"error: {one_line(e, source)}", file=sys.stderr, flush=True)
        return 1


def local_path(text: str) -> Path:
    """argparse type of a --from that must be on this machine (evaluate, embed): a URL is refused as written
    (pathlib would fold 's3://b/x' into 's3:/b/x'), saying what to do; anything else as a Path."""
    if "://" in text:
        raise argparse.ArgumentTypeError(f"'{text}' is a URL; a run directory or weights file on this machine is "
                                         f"expected: copy it here first (for a bucket: aws s3 cp --recursive {text} "
                                         f"runs/NAME)")
    return Path(text)
