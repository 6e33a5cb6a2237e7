"""patches: sliding window blending and sizes, TTA, fit-mode logits, the patch and whole-image datasets."""
import cv2
import numpy as np
import pytest
import torch

from unet_amp.common import IGNORE_INDEX
from unet_amp.patches import (PatchDataset, WholeImageDataset, fit_logits, sliding_window_logits, tile_starts,
                              tta_logits)
from unet_amp.precision import detect_hardware, precision_for

HW = detect_hardware("cpu")
FP32 = precision_for("fp32", False, "test")


class Constant(torch.nn.Module):
    def forward(self, x):
        return torch.full((x.shape[0], 2, *x.shape[2:]), 3.0)


class FirstChannel(torch.nn.Module):
    """Identity on channel 0: the blend of its tiles must give the image back."""

    def forward(self, x):
        return x[:, :1] * 1.0


def cfg(**over):
    return {"image_size": 32, "tile_overlap": 0.25, "patch_scale": 1.0, "tta": "none", "in_channels": 3,
            "num_classes": 1, "seed": 0, **over}


@pytest.mark.parametrize("h,w", [(100, 77), (31, 45), (32, 32), (65, 33)])
def test_sliding_window_weights_sum_to_one_and_size_kept(h, w):
    image = np.random.default_rng(0).normal(size=(h, w, 3)).astype(np.float32)
    out = sliding_window_logits(Constant(), image, cfg(), FP32, HW)
    assert out.shape == (2, h, w) and out.dtype == torch.float32
    assert torch.allclose(out, torch.full_like(out, 3.0), atol=1e-5)  # every pixel covered, weights normalised
    same = sliding_window_logits(FirstChannel(), image, cfg(tile_overlap=0.5), FP32, HW)
    assert torch.allclose(same[0], torch.from_numpy(image[..., 0]), atol=1e-4)


def test_sliding_window_at_patch_scale_gives_original_size():
    image = np.ones((75, 51, 3), np.float32)
    out = sliding_window_logits(FirstChannel(), image, cfg(patch_scale=0.5), FP32, HW)
    assert out.shape == (1, 75, 51)
    assert torch.allclose(out, torch.ones_like(out), atol=1e-4)


@pytest.mark.parametrize("length,overlap", [(100, 0.25), (33, 0.0), (32, 0.5), (257, 0.9)])
def test_tiles_cover_every_pixel(length, overlap):
    starts = tile_starts(length, 32, overlap)
    covered = np.zeros(max(length, 32), bool)
    for s in starts:
        covered[s:s + 32] = True
    assert covered.all() and starts[-1] + 32 == max(length, 32)


@pytest.mark.parametrize("tta", ["flip", "d4"])
def test_tta_of_an_equivariant_function_equals_plain(tta):
    blur = torch.nn.Conv2d(3, 2, 3, padding=1, bias=False)
    with torch.no_grad():
        blur.weight.copy_(torch.rand(2, 3, 1, 1).expand(2, 3, 3, 3) * torch.tensor([[1., 2, 1], [2, 4, 2], [1, 2, 1]]))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(tta_logits(blur, x, tta), blur(x), atol=1e-5)
        assert torch.allclose(tta_logits(blur, x[..., :24], "flip"), blur(x[..., :24]), atol=1e-5)


def test_tta_averages_views_of_a_non_equivariant_function():
    ramp = lambda m, x: x.cumsum(-1)  # noqa: E731 - not mirror-symmetric
    x = torch.ones(1, 1, 4, 4)
    assert torch.allclose(tta_logits(None, x, "flip", ramp), torch.full((1, 1, 4, 4), 2.5))


def test_fit_logits_back_at_each_original_size():
    images = [np.random.default_rng(i).normal(size=s).astype(np.float32) for i, s in
              enumerate([(50, 70, 3), (33, 21, 3), (64, 64, 3)])]
    out = fit_logits(FirstChannel(), images, cfg(image_size=64), FP32, HW)
    assert [tuple(y.shape) for y in out] == [(1, 50, 70), (1, 33, 21), (1, 64, 64)]
    assert torch.allclose(out[2][0], torch.from_numpy(images[2][..., 0]))


def write_pairs(root, sizes):
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    pairs = []
    for i, (h, w) in enumerate(sizes):
        rng = np.random.default_rng(i)
        image, mask = rng.integers(0, 255, (h, w, 3), dtype=np.uint8), np.zeros((h, w), np.uint8)
        mask[h // 3:h // 2, w // 4:w // 2] = 255
        cv2.imwrite(str(root / "images" / f"{i}.png"), image)
        cv2.imwrite(str(root / "masks" / f"{i}.png"), mask)
        pairs.append((root / "images" / f"{i}.png", root / "masks" / f"{i}.png"))
    return pairs


def test_patch_dataset_items_and_count(tmp_path):
    pairs = write_pairs(tmp_path, [(70, 50), (20, 25)])
    data = PatchDataset(pairs, cfg(), {"intensity_range": None})
    assert len(data) == 3 * 2 + 1  # enough patches to tile each image once
    for i in range(len(data)):
        x, y = data[i]
        assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.shape == (32, 32) and y.dtype == torch.int64
        assert set(y.unique().tolist()) <= {0, 1, IGNORE_INDEX}
    x, y = data[len(data) - 1]
    assert (y == IGNORE_INDEX).sum() == 32 * 32 - 20 * 25  # a small image is padded, the padding not scored
    assert torch.equal(data[2][0], data[2][0])
    data.set_epoch(1)
    assert any(not torch.equal(data[i][0], PatchDataset(pairs, cfg(), {"intensity_range": None})[i][0])
               for i in range(len(data)))


def test_patch_dataset_at_half_scale(tmp_path):
    pairs = write_pairs(tmp_path, [(128, 96)])
    assert len(PatchDataset(pairs, cfg(patch_scale=0.5), {"intensity_range": None})) == 2 * 2


def test_whole_image_dataset(tmp_path):
    pairs = write_pairs(tmp_path, [(41, 37)])
    x, y = WholeImageDataset(pairs, cfg(), {"intensity_range": None})[0]
    assert x.shape == (41, 37, 3) and x.dtype == torch.float32 and y.shape == (41, 37) and y.dtype == torch.int64
    assert set(y.unique().tolist()) == {0, 1}
