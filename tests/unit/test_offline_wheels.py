"""launch/offline_wheels.sh as docs/performance.md says to use it: its wheels installed with pip --no-index
--target into a folder, that folder first on PYTHONPATH, and the readers make_shards needs for TIFF and DICOM
read from it (issue 72: the script carried neither tifffile nor pydicom)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

READ = """
import sys, numpy as np, tifffile, pydicom
from pydicom.data import get_testdata_file
site = sys.argv[1]
assert tifffile.__file__.startswith(site) and pydicom.__file__.startswith(site), (tifffile.__file__, pydicom.__file__)
from pipeline.data.pixels import read_pixels
tiff = np.arange(2 * 5 * 7, dtype=np.uint16).reshape(2, 5, 7)  # two pages: two channels
tifffile.imwrite(sys.argv[2], tiff)
got = read_pixels(sys.argv[2]).array
assert got.shape == (5, 7, 2) and np.array_equal(got[..., 1], tiff[1]), got.shape
ct = read_pixels(get_testdata_file("CT_small.dcm")).array  # pydicom's wheel ships it
assert ct.shape[:2] == (128, 128) and ct.dtype == np.float32, (ct.shape, ct.dtype)  # its rescale applied
print("read", got.shape, ct.shape)
"""


@pytest.mark.slow  # pip download from the local index and DeepSpeed's wheel built: about 40 s
def test_an_offline_install_from_the_wheels_reads_tiff_and_dicom(tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"  # wheels for this Python, to install here
    dest, site = tmp_path / "whl", tmp_path / "site"
    made = subprocess.run(["bash", "launch/offline_wheels.sh", version, str(dest)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PY": sys.executable})
    assert made.returncode == 0, made.stderr[-3000:]
    wheels = sorted(p.name.split("-")[0].lower() for p in dest.glob("*.whl"))
    assert {"tifffile", "pydicom", "deepspeed", "webdataset"} <= set(wheels), wheels
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    *map(str, dest.glob("*.whl"))], check=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", READ, str(site), str(tmp_path / "two.tif")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("read (5, 7, 2) (128, 128"), out.stdout + out.stderr[-3000:]
