import pickle

import pytest
import torch

from pipeline.model.vit import build_vit
from pipeline.model.weights import WeightsError, load_weights, save_weights


def test_safetensors_round_trip(tmp_path):
    model = build_vit("vit_ti16", img_size=32, patch_size=8, depth=1, num_classes=3)
    save_weights(model.state_dict(), tmp_path / "m.safetensors")
    loaded = load_weights(tmp_path / "m.safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v)


def test_pth_with_wrapper_and_ddp_prefix(tmp_path):
    sd = {"module.head.weight": torch.ones(2, 2)}
    torch.save({"model": sd, "epoch": 3}, tmp_path / "m.pth")
    assert list(load_weights(tmp_path / "m.pth")) == ["head.weight"]


class Evil:
    def __reduce__(self):
        return (print, ("code ran",))


def test_pickle_with_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"head.weight": torch.ones(1), "x": Evil()}, f)
    with pytest.raises(WeightsError, match="evil.pth"):
        load_weights(path)
