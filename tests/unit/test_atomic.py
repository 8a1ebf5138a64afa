"""pipeline.atomic: the one atomic write every writer uses (model.safetensors included)."""

import os

import pytest
import torch

from pipeline import atomic
from pipeline.model.weights import save_weights


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    atomic.write_text(target, "new")
    assert target.read_text() == "new"
    assert os.listdir(tmp_path) == ["state.json"]


def test_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_temporary_names_are_unique_per_call(tmp_path):
    with atomic.atomic_path(tmp_path / "a") as one, atomic.atomic_path(tmp_path / "a") as two:
        assert one != two and one.parent == two.parent == tmp_path
        one.write_text("1")
        two.write_text("2")
    assert (tmp_path / "a").read_text() == "1"  # the outer block finished last


def test_model_safetensors_goes_through_it(tmp_path, monkeypatch):
    used = []
    real = atomic.atomic_path

    def spy(path):
        used.append(path)
        return real(path)

    monkeypatch.setattr("pipeline.model.weights.atomic_path", spy)
    save_weights({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    assert used == [tmp_path / "model.safetensors"] and os.listdir(tmp_path) == ["model.safetensors"]


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_a_file_gets_the_users_umask_whatever_its_writer_made(tmp_path, mask):
    """safetensors creates its file 0600 whatever the umask: a run's model.safetensors, a timm export, the
    embeddings' parts (all through atomic_path) would be unreadable by anyone else on a shared filesystem."""
    was = os.umask(mask)
    try:
        assert atomic.umask() == mask
        save_weights({"w": torch.ones(2)}, tmp_path / "model.safetensors")
        atomic.write_text(tmp_path / "notes.txt", "x")
    finally:
        os.umask(was)
    for name in ("model.safetensors", "notes.txt"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o666 & ~mask, name
