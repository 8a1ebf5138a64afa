"""Where a data set may send the job (pipeline/data/origins.py): a dataset.json served over HTTP whose shards
are named at another origin (a cloud metadata address, another server) is refused in one line before any
request goes there; with that origin in data.allowed_origins the loaders are built (test_data_http.py's runs train from a local
json naming URLs, allowed so). Real HTTP servers on loopback (tests/integration/faults.py), no training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.config import ConfigError, DataConfig, load_config
from pipeline.data import DataError, build_eval_loader, build_train_loader
from pipeline.data.origins import origin, within
from tests.integration.faults import FaultServer
from tests.unit.test_trust import IMG, dataset


def test_origins_are_compared_part_by_part_not_as_strings() -> None:
    assert origin("HTTPS://user@Host.example:443/a/b.tar") == "https://host.example"
    assert origin("http://10.0.0.7:8500/v1/kv") == "http://10.0.0.7:8500"
    assert within("s3://shared/datasets/a/0.tar", "s3://shared/datasets")
    assert not within("s3://shared-bucket/a.tar", "s3://shared")  # a string prefix, not the same bucket
    assert not within("s3://shared/datasets2/a.tar", "s3://shared/datasets")
    assert not within("s3://shared/datasets/../secrets/k", "s3://shared/datasets")
    assert not within("http://127.0.0.1:81/a.tar", "http://127.0.0.1:8")
    assert within("https://cdn.example.org/x/0.tar", "https://cdn.example.org:443")


def test_a_dataset_json_over_http_naming_another_origin_is_refused_unless_allowed(tmp_path: Path) -> None:
    folder = tmp_path / "served"
    folder.mkdir()
    name = dataset(folder).name  # one shard; its dataset.json is rewritten below to name it elsewhere
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(folder / name, other / name)
    with FaultServer(folder=folder) as home, FaultServer(folder=other) as elsewhere:
        for shard in ("http://169.254.169.254/latest/meta-data/iam/0.tar", f"{elsewhere.url}/{name}"):
            info = json.loads((folder / "dataset.json").read_text())
            for split in info["splits"].values():
                split["shards"][0]["name"] = shard
            (folder / "dataset.json").write_text(json.dumps(info))
            cfg = DataConfig(path=home.url, num_workers=0, shuffle_span=8, cache_dir=str(tmp_path / "cache"))
            for build in (build_train_loader, build_eval_loader):
                with pytest.raises(DataError) as e:
                    build(cfg, IMG, 4, seed=0) if build is build_train_loader else build(cfg, IMG, 4)
                msg = str(e.value)
                assert msg.startswith(f"{home.url}/dataset.json: split ") and "\n" not in msg, msg
                assert f"outside the data set's location (its own shards are under {home.url})" in msg, msg
                assert f"add '{origin(shard)}' to data.allowed_origins" in msg, msg
            assert elsewhere.log == []  # refused before any request went there
        allowed = DataConfig(path=home.url, num_workers=0, shuffle_span=8, cache_dir=str(tmp_path / "cache"),
                             allowed_origins=[elsewhere.url])
        build_train_loader(allowed, IMG, 4, seed=0)  # passes the check (test_data_http.py's runs train so)
        build_eval_loader(allowed, IMG, 4)


def test_a_local_dataset_json_naming_a_url_is_refused_unless_allowed(tmp_path: Path) -> None:
    dataset(tmp_path, names=["train-000000.tar", "https://host.example/train-0.tar"])
    with pytest.raises(DataError, match="it is a local file: its shards are local.*'https://host.example' to data"):
        build_train_loader(DataConfig(path=str(tmp_path), num_workers=0), IMG, 4, seed=0)


@pytest.mark.parametrize("entry", ["host.example", "ftp://host", "s3://", "http:///path"])
def test_an_allowed_origin_that_is_not_one_is_a_config_error(entry: str) -> None:
    with pytest.raises(ConfigError, match=r"data.allowed_origins\[0\] is .*expected an origin"):
        load_config(None, [f"data.allowed_origins=['{entry}']"])


def test_a_from_that_is_a_url_is_said_as_written() -> None:
    """evaluate's and embed's --from is a local path: an s3:// one is refused as typed (before: 's3:/...')."""
    import argparse

    from pipeline.errors import local_path

    with pytest.raises(argparse.ArgumentTypeError, match=r"^'s3://bucket/runs/a' is a URL; .*aws s3 cp --recursive "
                                                         r"s3://bucket/runs/a runs/NAME"):
        local_path("s3://bucket/runs/a")
    assert local_path("runs/a") == Path("runs/a")
