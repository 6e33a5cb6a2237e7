"""EMA decays side by side in ONE training run per seed (issue 23, item 2 measurement).

The EMA never touches training (no RNG, no gradient, no weight): with the same seed the raw weights follow
the same path whatever ema_decay is. So one run can carry several shadows and validate each of them every
epoch; the numbers are those separate `train_unet.py ema_decay=...` runs give (checked: on a 3-epoch run of
the real set, this script's `none` and `0.9` columns equal the val_iou of the CLI's own history.csv to
every printed digit).

    python tools/ema_sweep.py SEED [key=value ...]      # prints one CSV row per epoch and setting
Settings: none (raw weights, as ema_decay=None validates), 0.8, 0.9, 0.99 (the trainer's WeightEMA, with
its warm-up), and 0.99 without the warm-up (decay fixed from the first update: what the warm-up avoids).
"""
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import train_unet as T  # noqa: E402

WeightEMA = T.WeightEMA  # the trainer's class (T.WeightEMA is replaced by SweepEMA for the run)
DECAYS = (0.8, 0.9, 0.99)
RESULTS = []  # (epoch, setting, val_iou, val_dice, val_loss)
EPOCH = [0]


class NoWarmup(WeightEMA):
    def decay_at(self, n):
        return self.decay


class SweepEMA(WeightEMA):
    """The run's EMA (the first decay) plus the other shadows, all updated by the same one call."""

    def __init__(self, model=None, decay=None, compile_model=False):
        super().__init__(model, DECAYS[0])
        self.others = {str(d): WeightEMA(model, d) for d in DECAYS[1:]}
        self.others["0.99 no warm-up"] = NoWarmup(model, 0.99)

    def update(self, applied):
        super().update(applied)
        for ema in self.others.values():
            ema.update(applied)

    def evaluated(self, model):
        EPOCH[0] += 1
        SweepEMA.settings = {"none": model, str(DECAYS[0]): self.model,
                             **{name: ema.model for name, ema in self.others.items()}}
        return super().evaluated(model)


REAL_EVALUATE = T.evaluate


def evaluate(model, *args, **kwargs):
    """Validate every setting's weights; the run goes on with the first EMA's result."""
    first = None
    for name, weights in SweepEMA.settings.items():
        result = REAL_EVALUATE(weights, *args, **kwargs)
        RESULTS.append((EPOCH[0], name, result["iou"], result["dice"], result["loss"]))
        first = result if weights is model else first
    return first


def main(seed, overrides):
    T.keep_freed_memory()  # freed memory kept for reuse, as the script's commands run
    T.WeightEMA, T.evaluate = SweepEMA, evaluate
    cfg = T.parse_overrides([f"seed={seed}", *overrides])
    T.train(cfg)
    out = csv.writer(sys.stdout)
    out.writerow(["seed", "epoch", "setting", "val_iou", "val_dice", "val_loss"])
    for row in RESULTS:
        out.writerow([seed, *row])


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
