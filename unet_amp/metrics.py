"""Dataset-level IoU and Dice from a confusion matrix kept on the device."""
from __future__ import annotations

import torch

from unet_amp.common import IGNORE_INDEX


class ConfusionMatrix:
    """Pixel counts per (true class, predicted class), summed over every batch; IGNORE_INDEX not counted.

    Binary (num_classes=1, prediction logit > 0): iou/dice are the foreground's. Multi-class (argmax):
    iou/dice are the mean over the classes that appear in the target or the prediction; an absent class
    has NaN in the per-class lists, and when every class is absent the mean is 1.0 (nothing to find)."""

    def __init__(self, num_classes, device="cpu"):
        self.binary = num_classes == 1
        self.n = 2 if self.binary else num_classes
        assert self.n <= IGNORE_INDEX  # ignored pixels land past the n*n counts (see update)
        # n*n counts plus one bin that collects the ignored pixels
        self.flat = torch.zeros(self.n * self.n + 1, dtype=torch.int64, device=device)

    @torch.no_grad()
    def update(self, logits, target):
        """Count one batch. A fixed-size scatter-add: no host sync (torch.bincount reads its max back)."""
        pred = (logits[:, 0] > 0).long() if self.binary else logits.argmax(1)
        index = (target.long() * self.n + pred).reshape(-1).clamp_(max=self.n * self.n)
        index = index.to(self.flat.device)  # patch-mode validation counts host logits
        self.flat.scatter_add_(0, index, torch.ones_like(index))

    def all_reduce(self):
        """Sum the counts over torchrun processes (exact integers); returns self."""
        from unet_amp.distributed import all_reduce_

        all_reduce_(self.flat)
        return self

    def compute(self):
        """{"iou", "dice", "per_class_iou", "per_class_dice", "confusion"} (rows: true class, columns:
        predicted); binary per-class lists hold the foreground only. One device-to-host copy."""
        matrix = self.flat.cpu()[:self.n * self.n].view(self.n, self.n).double()
        tp = matrix.diag()
        fp, fn = matrix.sum(0) - tp, matrix.sum(1) - tp
        union = tp + fp + fn
        iou = torch.where(union > 0, tp / union.clamp(min=1), torch.nan)
        dice = torch.where(union > 0, 2 * tp / (union + tp).clamp(min=1), torch.nan)
        if self.binary:
            iou, dice = iou[1:], dice[1:]
        present = ~iou.isnan()
        return {"iou": _mean(iou, present), "dice": _mean(dice, present), "per_class_iou": iou.tolist(),
                "per_class_dice": dice.tolist(), "confusion": matrix.long().tolist()}


def _mean(values, present):
    return values[present].mean().item() if present.any() else 1.0
