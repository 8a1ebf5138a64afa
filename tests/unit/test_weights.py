import argparse
import pickle

import pytest
import torch
from safetensors.torch import save_file

from pipeline.model.layouts import convert_dinov2_state_dict, recognise
from pipeline.model.vit import VisionTransformer, build_vit
from pipeline.model.weights import NotWeightsFile, WeightsError, load_weights, save_weights, weights_format


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


# --- Meta's DINOv2 backbone files ---

def meta_dinov2_file(model, path, chunks: int = 0):
    """`model` (ours, a DINOv2 variant) saved in Meta's layout, written out by hand as DinoVisionTransformer's
    state_dict() has it: register_tokens, a (1, D) mask_token, pos_embed with the class token's row even with
    registers (Meta adds it to the class token), SwiGLU as w12/w3, the head (Identity) absent; `chunks` > 0
    is a training checkpoint's BlockChunk layout (blocks.CHUNK.I.*). Returns the tensors written."""
    ours = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith(("head.", "fc_norm."))}
    dim = model.embed_dim
    meta = {}
    if model.no_embed_class:
        class_row = torch.randn(1, 1, dim)
        meta["cls_token"] = ours.pop("cls_token") - class_row
        meta["pos_embed"] = torch.cat([class_row, ours.pop("pos_embed")], dim=1)
    else:
        meta["cls_token"], meta["pos_embed"] = ours.pop("cls_token"), ours.pop("pos_embed")
    if "reg_token" in ours:
        meta["register_tokens"] = ours.pop("reg_token")
    meta["mask_token"] = ours.pop("mask_token", torch.zeros(1, dim))
    swiglu = model.blocks[0].mlp.__class__.__name__ == "SwiGLU"
    per_chunk = -(-len(model.blocks) // chunks) if chunks else 0
    for key, value in ours.items():
        if swiglu:
            key = key.replace(".mlp.fc1.", ".mlp.w12.").replace(".mlp.fc2.", ".mlp.w3.")
        if chunks and key.startswith("blocks."):
            i = int(key.split(".")[1])
            key = f"blocks.{i // per_chunk}.{key.removeprefix('blocks.')}"
        meta[key] = value
    torch.save(meta, path)
    return meta


@pytest.mark.parametrize("name,chunks", [("vit_s14_reg4", 0), ("vit_s14", 2), ("vit_g14", 0)])
def test_meta_dinov2_file_converts_to_the_same_model(tmp_path, name, chunks):
    torch.manual_seed(0)
    small = dict(img_size=42, depth=3, num_classes=0)
    if name == "vit_g14":
        small.update(embed_dim=128, num_heads=2)
    model = build_vit(name, **small).eval()
    with torch.no_grad():  # O(1) LayerScale, tokens and positions, so that a misplaced one shows
        for n, p in model.named_parameters():
            if "gamma" in n or "token" in n or "pos_embed" in n:
                p.normal_()
    meta = meta_dinov2_file(model, tmp_path / "meta.pth", chunks)
    state = load_weights(tmp_path / "meta.pth")
    assert recognise(state).layout == "Meta's DINOv2 backbone"
    assert recognise(model.state_dict()).layout == "timm's VisionTransformer"  # ours, in timm's names
    converted, arch = convert_dinov2_state_dict(state)
    assert arch["img_size"] == 42 and arch["patch_size"] == 14 and arch["depth"] == 3
    assert arch["embed_dim"] == model.embed_dim and arch["num_heads"] == model.embed_dim // 64
    assert arch["reg_tokens"] == model.num_reg_tokens and arch["no_embed_class"] == model.no_embed_class
    assert arch["init_values"] and arch["mlp_layer"] == ("swiglu" if name == "vit_g14" else "mlp")
    assert "mask_token" not in converted
    rebuilt = VisionTransformer(**arch, num_classes=0).eval()
    rebuilt.load_state_dict(converted)  # strict: every key, every shape
    x = torch.randn(2, 3, 42, 42)
    with torch.no_grad():
        # cls_token is (cls - row) + row in float32: equal up to one rounding.
        torch.testing.assert_close(rebuilt.forward_features(x), model.forward_features(x), atol=1e-5, rtol=1e-5)
    kept, _ = convert_dinov2_state_dict(state, keep_mask_token=True)
    assert torch.equal(kept["mask_token"], meta["mask_token"])


def test_meta_dinov2_file_errors_name_the_file():
    with pytest.raises(WeightsError, match=r"x.pth: cls_token has shape \(1, 4\)"):
        convert_dinov2_state_dict({"cls_token": torch.zeros(1, 4), "pos_embed": torch.zeros(1, 5, 4),
                                   "mask_token": torch.zeros(1, 4)}, source="x.pth")


# --- formats, by what defines each ---

def safetensors_with_header(path, length: int, state: dict[str, torch.Tensor]) -> None:
    """`state` saved as safetensors with a JSON header of exactly `length` bytes (the metadata padded)."""
    save_file(state, str(path), metadata={"pad": ""})
    base = int.from_bytes(path.read_bytes()[:8], "little")
    for pad in range(max(length - base - 8, 0), length - base + 8):  # the writer pads its header to 8 bytes
        save_file(state, str(path), metadata={"pad": "x" * pad})
        if int.from_bytes(path.read_bytes()[:8], "little") == length:
            return
    raise AssertionError(f"no padding gives a {length}-byte header")


@pytest.mark.parametrize("length", [128, 384, 640, 2688])
@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_safetensors_is_told_by_its_header_whatever_its_first_byte_and_name(tmp_path, length, suffix):
    # Lengths of 128 mod 256 start the file with 0x80, a pickle's first byte; 640 (80 02) reads as pickle protocol 2.
    from pipeline.run.finetune import find_source

    state = {"w": torch.randn(4)}  # a header shorter than 128 bytes before its padding
    path = tmp_path / f"m{suffix}"
    safetensors_with_header(path, length, state)
    assert path.read_bytes()[0] == 0x80
    assert weights_format(path) == "safetensors"
    find_source(str(path))  # --from takes it
    loaded = load_weights(path)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_torch_zip_legacy_pickle_and_what_is_neither(tmp_path):
    state = {"w": torch.arange(3.0)}
    torch.save(state, tmp_path / "zip.pth")
    torch.save(state, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    assert weights_format(tmp_path / "zip.pth") == "torch zip"
    assert weights_format(tmp_path / "legacy.pth") == "pickle"
    assert torch.equal(load_weights(tmp_path / "legacy.pth")["w"], state["w"])
    (tmp_path / "zip.safetensors").write_bytes((tmp_path / "zip.pth").read_bytes())
    with pytest.raises(NotWeightsFile, match="it is a torch.save zip file named .safetensors"):
        weights_format(tmp_path / "zip.safetensors")
    save_file(state, str(tmp_path / "cut.safetensors"))
    whole = (tmp_path / "cut.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[:40])  # inside its header
    with pytest.raises(NotWeightsFile, match=r"a \d+-byte header, but only 32 bytes follow the length: truncated"):
        weights_format(tmp_path / "cut.safetensors")
    (tmp_path / "cut.safetensors").write_bytes(whole[:-4])  # inside its data
    with pytest.raises(NotWeightsFile, match=r"tensor 'w' is not a dtype, a shape and data_offsets within its 8 bytes"):
        weights_format(tmp_path / "cut.safetensors")
    (tmp_path / "empty.pth").write_bytes(b"")
    with pytest.raises(WeightsError, match="empty.pth' is not a weights file: it is empty"):
        load_weights(tmp_path / "empty.pth")


@pytest.mark.parametrize("header, says", [
    (b'{"w":{"dtype":"XX","shape":[1],"data_offsets":[0,4]}}', "unknown variant `XX`"),  # safetensors' parser refuses
    (b'{"__metadata__":{"step":1},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', "expected a string"),
    (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', "invalid shape, data type, or offset"),
    (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}', "whose header is not JSON"),  # ours refuses
])
def test_a_malformed_safetensors_header_is_one_line_naming_the_file_from_every_reader(tmp_path, header, says):
    from pipeline.model.weights import weights_metadata

    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    for read in (load_weights, weights_metadata):
        with pytest.raises(WeightsError) as e:
            read(path)
        assert str(e.value).startswith(f"'{path}' is not a weights file: ") and says in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


def test_an_oversized_header_length_is_called_what_it_is(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes((1 << 40).to_bytes(8, "little") + b'{"w": 1}' + bytes(100))  # 2^40: NUL bytes read as text
    with pytest.raises(WeightsError, match=r"a header length of 1,099,511,627,776 bytes, over safetensors' limit of "
                                           r"100,000,000: damaged, or not safetensors$"):
        load_weights(path)


def test_maes_training_args_load_but_code_inside_them_does_not_run(tmp_path):
    """main_pretrain.py saves its argparse.Namespace beside the model: rebuilt from plain values, nothing else."""
    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=1e-3, model="mae")}, tmp_path / "ok.pth")
    assert list(load_weights(tmp_path / "ok.pth")) == ["w"]
    with open(tmp_path / "evil.pth", "wb") as f:
        pickle.dump({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=Evil())}, f, protocol=2)
    with pytest.raises(WeightsError, match="would run code"):
        load_weights(tmp_path / "evil.pth")
