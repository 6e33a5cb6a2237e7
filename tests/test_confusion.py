"""The confusion matrix of multi-class runs: its counts are the IoU's counts; saved at the best epoch
(CSV, normalised per true class, with class names), drawn in TensorBoard and in my_run.ipynb."""
import csv
from pathlib import Path

import numpy as np
import pytest
import torch

import train_unet
from train_unet import IGNORE_INDEX, SegMetric


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_confusion_counts_are_the_iou_counts():
    """Rows = true class, columns = predicted class: the same counts per class IoU/Dice come from, and
    exactly the (true, predicted) pairs of the real pixels (ignored ones left out)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 16, 16, generator=g)
    target = torch.randint(0, 4, (3, 16, 16), generator=g)
    target[0, :5] = IGNORE_INDEX
    metric = SegMetric(4)
    metric.update(logits[:2], target[:2])
    metric.update(logits[2:], target[2:])
    result = metric.compute()
    counts = np.array(metric.confusion())
    pred, true = logits.argmax(1).numpy().ravel(), target.numpy().ravel()
    real = true != IGNORE_INDEX
    expected = np.zeros((4, 4), np.int64)
    np.add.at(expected, (true[real], pred[real]), 1)
    assert counts.tolist() == expected.tolist() and counts.sum() == real.sum()
    tp = np.diag(counts)
    iou = tp / (counts.sum(0) + counts.sum(1) - tp)
    dice = 2 * tp / (counts.sum(0) + counts.sum(1))
    assert iou.tolist() == pytest.approx(result["per_class_iou"])
    assert dice.tolist() == pytest.approx(result["per_class_dice"])


def test_binary_confusion_is_background_and_foreground():
    metric = SegMetric(1)
    metric.update(torch.tensor([[[[1.0, -1.0], [2.0, -3.0]]]]), torch.tensor([[[1, 1], [0, IGNORE_INDEX]]]))
    assert metric.confusion() == [[0, 1], [1, 1]]  # true bg: 1 predicted fg; true fg: 1 each


def test_saved_at_the_best_epoch_normalised_per_true_class(make_cfg, make_data, tmp_path, monkeypatch):
    """A 3-class run writes both CSVs at its best epoch, with the class names; the shares of each true
    class sum to 1 and are its counts over its pixels; TensorBoard gets a figure every epoch."""
    data = make_data("multi", num_classes=3)
    (data / "class_names.txt").write_text("background\nround thing\nbox\n")
    figures = []
    monkeypatch.setattr(train_unet.RunLogger, "log_confusion",
                        lambda self, counts, names, epoch: figures.append((epoch, names, counts)))
    epochs_run = []
    real_save = train_unet.save_confusion

    def save(ckpt_dir, counts, names):
        epochs_run.append(counts)
        real_save(ckpt_dir, counts, names)
    monkeypatch.setattr(train_unet, "save_confusion", save)
    cfg = make_cfg(data_dir=str(data), num_classes=3, epochs=2, early_stopping_patience=None)
    result = train_unet.train(cfg)
    ckpt = tmp_path / "ckpt"
    best = max(range(2), key=lambda i: (result["history"][i]["val_iou"], -i))  # the first of equals
    assert [e for e, _, _ in figures] == [1, 2] and figures[0][1] == ["background", "round thing", "box"]
    assert epochs_run[-1] == figures[best][2]  # the file holds the best epoch's matrix
    counts = read_csv(ckpt / "confusion_counts.csv")
    shares = read_csv(ckpt / "confusion_matrix.csv")
    assert counts[0] == shares[0] == ["true \\ predicted", "background", "round thing", "box"]
    assert [row[0] for row in counts[1:]] == ["background", "round thing", "box"]
    matrix = [[int(c) for c in row[1:]] for row in counts[1:]]
    assert matrix == figures[best][2]
    for row_counts, row_shares in zip(matrix, shares[1:]):
        if sum(row_counts):
            assert [float(s) for s in row_shares[1:]] == pytest.approx([c / sum(row_counts) for c in row_counts])
            assert sum(float(s) for s in row_shares[1:]) == pytest.approx(1.0)
    assert "confusion_counts.csv" in train_unet.RUN_FILES  # archived with the run by the next one


def test_binary_runs_write_no_confusion_files(make_cfg, tmp_path):
    train_unet.train(make_cfg())
    assert not any((tmp_path / "ckpt" / name).exists() for name in train_unet.CONFUSION_FILES)


def test_tensorboard_figure_is_drawn(tmp_path):
    pytest.importorskip("tensorboard")
    logger = train_unet.RunLogger(tmp_path / "tb", {})
    logger.log_confusion([[5, 1, 0], [2, 8, 0], [0, 0, 0]], ["bg", "a", "b"], 1)
    logger.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "class/confusion_matrix" in acc.Tags()["images"]


def test_class_names_its_font_cannot_draw_give_no_warnings(tmp_path):
    """'фон, road sign, 犬': 'UserWarning: Glyph 29356 ... missing from font(s) DejaVu Sans', twice an epoch,
    with the script's file and line."""
    pytest.importorskip("tensorboard")
    import warnings

    logger = train_unet.RunLogger(tmp_path / "tb", {})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        logger.log_confusion([[5, 1, 0], [2, 8, 0], [0, 0, 3]], ["фон", "road sign", "犬"], 1)
    logger.close()
    assert [str(w.message) for w in seen if "Glyph" in str(w.message)] == []


def test_figure_shows_shares_per_true_class():
    fig = train_unet.confusion_figure([[3, 1], [0, 0]], ["bg", "fg"])
    texts = sorted(t.get_text() for t in fig.axes[0].texts)
    assert texts == ["0.25", "0.75"]  # the empty true class has no shares


@pytest.mark.parametrize("length", [40, 5000])
def test_long_class_names_are_cut_and_fit_the_figure(length):
    """A 40-character class name had no room beside the cells: cut off in the figure, and matplotlib warned
    'Tight layout not applied' every epoch. Names longer than CONFUSION_NAME_CHARS are cut, with an ellipsis."""
    import warnings

    long = "W" * length
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the tight_layout warning fails the test
        fig = train_unet.confusion_figure([[5, 1, 0], [2, 7, 0], [0, 0, 1]], ["bg", long, "road sign"])
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    cut = long[:train_unet.CONFUSION_NAME_CHARS - 1] + "…"
    assert labels == ["bg", cut, "road sign"]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == labels
    readme = (Path(train_unet.__file__).parent / "README.md").read_text()
    assert f"names over {train_unet.CONFUSION_NAME_CHARS} characters cut" in readme
