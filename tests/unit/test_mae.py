"""MAE: what the official implementation (facebookresearch/mae, models_mae.py, util/pos_embed.py) and the
paper fix, pinned from their text: Meta's state-dict layout, the sin-cos tables, which patches `noise`
keeps, the norm-pix target and the loss on removed patches only."""

import math

import numpy as np
import pytest
import torch

from pipeline.model.mae import build_mae, mae_flops, mae_kwargs, random_masking, sincos_pos_embed_2d
from pipeline.model.vit import build_vit, model_flops, variant_kwargs


def tiny(**overrides):
    """B/16's structure at toy size: 4x4 patches of a 16x16 image, 2 + 1 blocks."""
    kw = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16,
              decoder_depth=1, decoder_num_heads=2)
    kw.update(overrides)
    torch.manual_seed(0)
    return build_mae("vit_ti16", **kw)


def meta_layout_mae_vit_base_patch16() -> dict[str, tuple[int, ...]]:
    """The state dict of the official mae_vit_base_patch16 (= dec512d8b), written out from models_mae.py:
    timm Blocks (norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2) with mlp_ratio 4, 196 patches + cls."""
    def block(prefix: str, d: int) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.norm1.weight": (d,), f"{prefix}.norm1.bias": (d,),
                f"{prefix}.attn.qkv.weight": (3 * d, d), f"{prefix}.attn.qkv.bias": (3 * d,),
                f"{prefix}.attn.proj.weight": (d, d), f"{prefix}.attn.proj.bias": (d,),
                f"{prefix}.norm2.weight": (d,), f"{prefix}.norm2.bias": (d,),
                f"{prefix}.mlp.fc1.weight": (4 * d, d), f"{prefix}.mlp.fc1.bias": (4 * d,),
                f"{prefix}.mlp.fc2.weight": (d, 4 * d), f"{prefix}.mlp.fc2.bias": (d,)}

    sd = {"cls_token": (1, 1, 768), "pos_embed": (1, 197, 768), "patch_embed.proj.weight": (768, 3, 16, 16),
          "patch_embed.proj.bias": (768,), "norm.weight": (768,), "norm.bias": (768,),
          "mask_token": (1, 1, 512), "decoder_pos_embed": (1, 197, 512), "decoder_embed.weight": (512, 768),
          "decoder_embed.bias": (512,), "decoder_norm.weight": (512,), "decoder_norm.bias": (512,),
          "decoder_pred.weight": (16 * 16 * 3, 512), "decoder_pred.bias": (16 * 16 * 3,)}
    for i in range(12):
        sd.update(block(f"blocks.{i}", 768))
    for i in range(8):
        sd.update(block(f"decoder_blocks.{i}", 512))
    return sd


def test_state_dict_is_metas_mae_vit_base_patch16():
    with torch.device("meta"):
        model = build_mae("vit_b16")
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == meta_layout_mae_vit_base_patch16()
    # Trained: everything but the two fixed tables (requires_grad=False there).
    trained = {n for n, _ in model.named_parameters()}
    assert "pos_embed" not in trained and "decoder_pos_embed" not in trained and "mask_token" in trained
    assert sum(math.prod(p.shape) for p in model.parameters()) == pytest.approx(111.65e6, rel=1e-3)


def test_a_checkpoint_in_metas_layout_loads_unchanged_and_the_encoder_loads_into_the_vit():
    model = tiny()
    foreign = {k: torch.randn_like(v) for k, v in model.state_dict().items()}  # "Meta's" weights
    fresh = tiny()
    fresh.load_state_dict(foreign)  # strict: same keys, same shapes
    assert torch.equal(fresh.decoder_pred.weight, foreign["decoder_pred.weight"])
    encoder = {k: v for k, v in foreign.items() if not k.startswith(("decoder", "mask_token"))}
    vit = build_vit("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0)
    vit.load_state_dict(encoder)  # timm's names: fine-tuning takes the encoder as it is


def official_sincos(dim: int, size: int) -> np.ndarray:
    """util/pos_embed.py's get_2d_sincos_pos_embed(dim, size, cls_token=True), restated: np.meshgrid with
    the w axis first, the first half of the channels from grid[0] (which holds the column index)."""
    grid = np.stack(np.meshgrid(np.arange(size, dtype=np.float32), np.arange(size, dtype=np.float32)), axis=0)

    def one_d(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    emb = np.concatenate([one_d(dim // 2, grid[0]), one_d(dim // 2, grid[1])], axis=1)
    return np.concatenate([np.zeros([1, dim]), emb], axis=0)


@pytest.mark.parametrize("dim,size", [(768, 14), (512, 14), (1024, 16), (16, 3)])
def test_sincos_table_is_the_official_formula(dim, size):
    ours = sincos_pos_embed_2d(dim, size)
    assert ours.shape == (1, size * size + 1, dim) and ours.dtype == torch.float32
    expected = torch.from_numpy(official_sincos(dim, size)).float().unsqueeze(0)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


def test_sincos_channels_by_hand():
    t = sincos_pos_embed_2d(8, (2, 3))[0]  # rows 2, columns 3; omega = [1, 1e-2] for dim/4 = 2
    assert torch.equal(t[0], torch.zeros(8))  # class token
    row1_col2 = t[1 + 1 * 3 + 2]  # token i * w + j
    expected = [math.sin(2), math.sin(0.02), math.cos(2), math.cos(0.02),  # column 2 first
                math.sin(1), math.sin(0.01), math.cos(1), math.cos(0.01)]  # then row 1
    torch.testing.assert_close(row1_col2, torch.tensor(expected), atol=1e-7, rtol=0)


def test_model_buffers_are_the_tables():
    model = tiny()
    exported = model.to(torch.bfloat16).fp32_buffers()  # a bf16 engine casts buffers; the export stays exact
    assert exported["pos_embed"].dtype == torch.float32
    torch.testing.assert_close(exported["pos_embed"], sincos_pos_embed_2d(32, 4), atol=0, rtol=0)
    torch.testing.assert_close(exported["decoder_pos_embed"], sincos_pos_embed_2d(16, 4), atol=0, rtol=0)
    model = tiny()
    torch.testing.assert_close(model.pos_embed, sincos_pos_embed_2d(32, 4), atol=0, rtol=0)
    torch.testing.assert_close(model.decoder_pos_embed, sincos_pos_embed_2d(16, 4), atol=0, rtol=0)


def test_noise_keeps_the_patches_with_the_smallest_noise():
    torch.manual_seed(1)
    x = torch.randn(3, 16, 5)
    noise = torch.rand(3, 16)
    kept, mask, ids_restore = random_masking(x, 0.75, noise)
    assert kept.shape == (3, 4, 5)  # int(16 * 0.25)
    for n in range(3):
        order = noise[n].argsort()
        torch.testing.assert_close(kept[n], x[n, order[:4]])  # in ascending-noise order
        expected = torch.ones(16)
        expected[order[:4]] = 0  # 0 = kept, 1 = removed, in patch order
        assert torch.equal(mask[n], expected)
        # ids_restore puts [kept, removed] back into patch order
        shuffled = x[n, order]
        torch.testing.assert_close(shuffled[ids_restore[n]], x[n])
    # int(L * (1 - r)) kept, as the official (196 at 0.75 -> 49)
    assert random_masking(torch.zeros(1, 196, 1), 0.75)[1].sum() == 147


def test_same_noise_same_mask_and_loss_noise_changes_them():
    model = tiny().eval()
    imgs = torch.randn(2, 3, 16, 16)
    noise = torch.rand(2, 16)
    with torch.no_grad():
        a, b = model(imgs, noise=noise), model(imgs, noise=noise.clone())
        c = model(imgs, noise=torch.rand(2, 16))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert a[1].shape == (2, 16, 48) and a[2].shape == (2, 16)
    assert not torch.equal(a[2], c[2])
    assert torch.equal(a[2], (noise.argsort(1).argsort(1) >= 4).float())  # the 4 smallest kept


def test_decoder_prediction_is_the_paper_written_out_patch_by_patch():
    """The always-run twin of test_mae_official.py (which needs Meta's checkout): the prediction by hand.
    Encoder on the class token and the kept patches (by the noise), then one decoder input per patch in
    patch order: decoder_embed of the patch's encoding where it was kept, the shared mask token where it
    was removed, plus the decoder's sin-cos table; the decoder blocks, its norm, decoder_pred, class token
    dropped. Mask tokens are distinct from any kept token, so a restore in the wrong order shows."""
    model = tiny(decoder_depth=2).eval()
    with torch.no_grad():
        model.mask_token.normal_()
    imgs, noise = torch.randn(2, 3, 16, 16), torch.rand(2, 16)
    with torch.no_grad():
        _, pred, mask = model(imgs, noise=noise)
        for n in range(2):
            kept = noise[n].argsort()[:4].tolist()  # the 4 smallest noises, in ascending order
            assert sorted(kept) == [i for i in range(16) if mask[n, i] == 0]
            patches = model.patch_embed(imgs[n:n + 1])[0] + model.pos_embed[0, 1:]
            tokens = torch.cat([model.cls_token[0] + model.pos_embed[0, :1], patches[kept]])
            for block in model.blocks:
                tokens = block(tokens[None])[0]
            latent = model.decoder_embed(model.norm(tokens))
            rows = [latent[0]] + [latent[1 + kept.index(i)] if i in kept else model.mask_token[0, 0]
                                  for i in range(16)]
            x = torch.stack(rows) + model.decoder_pos_embed[0]
            for block in model.decoder_blocks:
                x = block(x[None])[0]
            want = model.decoder_pred(model.decoder_norm(x))[1:]
            torch.testing.assert_close(pred[n], want, atol=1e-5, rtol=1e-5)


def test_patchify_order_and_inverse():
    model = tiny()
    imgs = torch.randn(2, 3, 16, 16)
    patches = model.patchify(imgs)
    assert patches.shape == (2, 16, 48)
    # patch (row 1, column 2), pixel (row 3, column 0), channel 2 -> index (3 * 4 + 0) * 3 + 2
    assert patches[1, 1 * 4 + 2, (3 * 4 + 0) * 3 + 2] == imgs[1, 2, 4 + 3, 8 + 0]
    assert torch.equal(model.unpatchify(patches), imgs)


def test_norm_pix_target_is_per_patch_mean_and_unbiased_variance():
    model = tiny()
    imgs = torch.randn(2, 3, 16, 16) * 3 + 1
    target = model.target(imgs)
    raw = model.patchify(imgs)
    for n, k in [(0, 0), (1, 7), (1, 15)]:
        values = raw[n, k].double().tolist()
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)  # unbiased
        expected = torch.tensor([(v - mean) / math.sqrt(var + 1e-6) for v in values])
        torch.testing.assert_close(target[n, k].double(), expected.double(), atol=1e-5, rtol=0)
    # eps 1e-6: a flat patch gives 0, a patch of 0 and 2e-3 gives +-2e-3 / sqrt(2e-6 + 1e-6) per pixel
    flat = torch.zeros(1, 3, 16, 16)
    flat[..., :4, :4] = torch.tensor([0.0, 2e-3]).repeat(8)[:16].reshape(4, 4)  # channel-wise the same
    t = model.target(flat)
    assert torch.all(t[0, 1:] == 0)
    values = model.patchify(flat)[0, 0].double()
    var = values.var().item()
    torch.testing.assert_close(t[0, 0].double(), (values - values.mean()) / math.sqrt(var + 1e-6), atol=1e-6,
                               rtol=0)
    assert not torch.allclose(t[0, 0].double(), (values - values.mean()) / math.sqrt(var), atol=1e-3)
    assert torch.equal(tiny(norm_pix_loss=False).target(imgs), raw)


def test_loss_is_on_removed_patches_only():
    model = tiny()
    imgs = torch.randn(2, 3, 16, 16)
    pred = torch.randn(2, 16, 48)
    mask = torch.zeros(2, 16)
    mask[0, [1, 5]] = 1
    mask[1, 9] = 1
    loss = model.forward_loss(imgs, pred, mask)
    per_patch = ((pred - model.target(imgs)) ** 2).mean(-1)
    torch.testing.assert_close(loss, (per_patch[0, 1] + per_patch[0, 5] + per_patch[1, 9]) / 3)
    kept_changed = pred.clone()
    kept_changed[mask == 0] += 100.0  # a kept patch's prediction does not count
    torch.testing.assert_close(model.forward_loss(imgs, kept_changed, mask), loss)
    removed_changed = pred.clone()
    removed_changed[1, 9] += 1.0
    assert model.forward_loss(imgs, removed_changed, mask) > loss


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    imgs, noise = torch.randn(2, 3, 16, 16), torch.rand(2, 16)
    grads = []
    for ckpt in (False, True):
        model = tiny()
        model.set_grad_checkpointing(ckpt)
        loss = model(imgs, noise=noise)[0]
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=0, rtol=0)
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, atol=1e-6, rtol=1e-5)
    assert grads[0][1]["mask_token"].abs().sum() > 0  # the decoder's mask token is trained


def test_official_initialisation():
    model = build_mae("vit_ti16", img_size=32, patch_size=16, depth=1, decoder_depth=1)
    w = model.blocks[0].mlp.fc1.weight  # (768, 192): xavier bound sqrt(6 / (192 + 768))
    bound = math.sqrt(6 / (192 + 768))
    assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
    assert torch.all(model.blocks[0].mlp.fc1.bias == 0)
    assert model.mask_token.std().item() == pytest.approx(0.02, rel=0.3)
    proj = model.patch_embed.proj.weight  # xavier over (192, 3 * 16 * 16)
    assert proj.abs().max() <= math.sqrt(6 / (192 + 768))


def test_build_mae_variants_and_overrides():
    assert mae_kwargs("vit_l16", img_size=224) == dict(variant_kwargs("vit_l16", img_size=224), decoder_embed_dim=512,
                                         decoder_depth=8, decoder_num_heads=16)
    assert mae_kwargs("vit_b16", decoder_depth=4, norm_pix_loss=False)["decoder_depth"] == 4
    with pytest.raises(ValueError, match="num_classes"):
        build_mae("vit_b16", num_classes=10)
    with pytest.raises(KeyError, match="vit_b16"):
        build_mae("vit_q16")


def test_mae_flops_count_encoder_on_visible_patches_and_decoder_on_all():
    kw = mae_kwargs("vit_b16")
    # No masking and no decoder blocks: the ViT without a head, plus decoder_embed and decoder_pred.
    bare = mae_flops(dict(kw, decoder_depth=0), mask_ratio=0.0)
    vit = model_flops(variant_kwargs("vit_b16", num_classes=0))
    assert bare == pytest.approx(vit + 2 * 197 * (768 * 512 + 512 * 768))
    # ViT-L (the paper's speed-up case): the encoder on 25% of the patches and the 8 x 512 decoder on all
    # cost about a third of a supervised step. B/16: the decoder weighs as much as the encoder (0.56).
    for variant, lo, hi in [("vit_l16", 0.30, 0.40), ("vit_b16", 0.50, 0.60), ("vit_h14", 0.25, 0.32)]:
        ratio = mae_flops(mae_kwargs(variant, img_size=224)) / model_flops(variant_kwargs(variant, num_classes=1000))
        assert lo < ratio < hi, variant


def test_average_pool_with_fc_norm_is_timms_global_pool_avg():
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    torch.manual_seed(0)
    ours = build_vit("vit_ti16", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                     global_pool="avg").eval()
    theirs = TimmViT(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                     global_pool="avg").eval()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert "fc_norm.weight" in ours.state_dict() and "norm.weight" not in ours.state_dict()
    theirs.load_state_dict({k: torch.randn_like(v) for k, v in theirs.state_dict().items()})
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)


def test_one_channel_mae_patchifies_predicts_and_trains_on_its_channel():
    """Issue 62: MAE of model.in_chans 1 (a 16-bit CT slice, say): patches of P x P x 1, the decoder's output
    and pixel target of that width, and a few steps on one normalised batch lower its loss (same mask)."""
    model = tiny(in_chans=1)
    imgs = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    patches = model.patchify(imgs)
    assert patches.shape == (4, 16, 16) and torch.equal(model.unpatchify(patches), imgs)
    noise = torch.rand(4, 16, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss, pred, mask = model(imgs, 0.75, noise)
        assert pred.shape == (4, 16, 16) and int(mask.sum()) == 4 * 12
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
