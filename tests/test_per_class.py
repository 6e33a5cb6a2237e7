"""Per-class IoU/Dice: history columns that follow num_classes, class_names.txt, the end-of-run table."""
import csv
import io
import math
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train_unet
from train_unet import HISTORY_FIELDS, SegMetric, UserError, load_class_names, train


@pytest.fixture
def multi_data(make_data):
    return make_data("multi", num_classes=3)


def history_csv(ckpt):
    with open(Path(ckpt) / "history.csv", newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_named_classes_get_columns_tensorboard_tags_and_a_table(make_cfg, multi_data, capsys):
    (multi_data / "class_names.txt").write_text("background\nround thing\nbox\n")
    cfg = make_cfg(data_dir=str(multi_data), num_classes=3, epochs=2)
    result = train(cfg)
    out = capsys.readouterr().out
    fields, rows = history_csv(cfg["checkpoint_dir"])
    names = ("background", "round_thing", "box")
    assert fields[:len(HISTORY_FIELDS)] == list(HISTORY_FIELDS)
    assert fields[len(HISTORY_FIELDS):] == [f"val_iou_{n}" for n in names] + [f"val_dice_{n}" for n in names]
    for row in result["history"]:
        ious = [row[f"val_iou_{n}"] for n in names]
        present = [v for v in ious if not math.isnan(v)]
        assert row["val_iou"] == pytest.approx(sum(present) / len(present))  # mIoU is their mean
    assert float(rows[-1]["val_iou_box"]) == pytest.approx(result["history"][-1]["val_iou_box"], nan_ok=True)
    # the end-of-run table, with the names as written in class_names.txt, at the best epoch
    best = max(result["history"], key=lambda r: r["val_iou"])
    table = out.split("val per class at the best epoch")[1]
    assert f"({best['epoch']})" in table.splitlines()[0]
    assert "round thing" in table and "background" in table and f"{best['val_iou']:.4f}" in table
    acc = EventAccumulator(str(Path(cfg["checkpoint_dir"]) / "tensorboard"))
    acc.Reload()
    assert {f"class/val_iou_{n}" for n in names} <= set(acc.Tags()["scalars"])


def test_a_resume_with_renamed_classes_is_refused_and_the_same_names_resume(make_cfg, multi_data):
    """Renamed between two epochs, the classes' values of epoch 2 had no column in history.csv: blank."""
    (multi_data / "class_names.txt").write_text("bg\ncellA\ncellB\n")
    cfg = make_cfg(data_dir=str(multi_data), num_classes=3, epochs=1)
    train(cfg)
    (multi_data / "class_names.txt").write_text("background\nnucleus\nmembrane\n")
    with pytest.raises(UserError, match="names the classes background, nucleus, membrane; this run began with "
                                        "bg, cellA, cellB"):
        train({**cfg, "epochs": 2, "resume": True})
    (multi_data / "class_names.txt").unlink()  # it was named as if there, with names it had not
    with pytest.raises(UserError, match=r"cannot resume exactly: there is no .*class_names.txt now \(the classes "
                                        r"would be called 0, 1, 2\); this run began with bg, cellA, cellB"):
        train({**cfg, "epochs": 2, "resume": True})
    (multi_data / "class_names.txt").write_text("bg\ncellA\ncellB\n")
    train({**cfg, "epochs": 2, "resume": True})
    _, rows = history_csv(cfg["checkpoint_dir"])
    assert all(row["val_iou_cellA"] != "" for row in rows)


def test_per_class_values_are_the_metric_s(multi_data):
    metric = SegMetric(3)
    logits = torch.zeros(1, 3, 2, 2)
    logits[0, 1, 0, :] = 1  # predict class 1 in the top row, class 0 below
    metric.update(logits, torch.tensor([[[1, 1], [2, 0]]]))
    names = ["bg", "a", "b"]
    cols = train_unet.per_class_columns(metric.compute(), names)
    assert cols["val_iou_a"] == 1.0 and cols["val_iou_bg"] == 0.5 and cols["val_iou_b"] == 0.0
    assert cols["val_dice_bg"] == pytest.approx(2 / 3)


def test_without_class_names_the_columns_are_indices(make_cfg, multi_data):
    cfg = make_cfg(data_dir=str(multi_data), num_classes=3)
    train(cfg)
    fields, _ = history_csv(cfg["checkpoint_dir"])
    assert fields[len(HISTORY_FIELDS):] == ["val_iou_0", "val_iou_1", "val_iou_2",
                                            "val_dice_0", "val_dice_1", "val_dice_2"]


def test_binary_runs_keep_the_fixed_columns(tmp_path):
    # one class, the foreground: val_iou is its IoU already
    assert train_unet.per_class_columns({"per_class_iou": [0.5], "per_class_dice": [0.6]}, ["road"]) == {}
    (tmp_path / "class_names.txt").write_text("background\nroad\n")
    assert load_class_names({"data_dir": str(tmp_path), "num_classes": 1}) == ["road"]


def test_a_byte_order_mark_is_not_part_of_the_first_name(tmp_path):
    """Windows Notepad saves UTF-8 with a BOM (and CRLF): class 0 was named '\ufeffbg' in the confusion CSVs."""
    (tmp_path / "class_names.txt").write_bytes(b"\xef\xbb\xbfbg\r\ncellA\r\ncellB\r\n")
    assert load_class_names({"data_dir": str(tmp_path), "num_classes": 3}) == ["bg", "cellA", "cellB"]


@pytest.mark.parametrize("text, names", [
    ("0 background\n1 road\n2 sky\n", ["background", "road", "sky"]),
    ("0: background\n1:road\n2,  road sign\n", ["background", "road", "road sign"]),
    ("0\tbg\n1\tcell\n2\tdebris\n", ["bg", "cell", "debris"]),
    ("0 bg\n2 debris\n1 cell\n", ["bg", "cell", "debris"]),  # by the numbers: 'debris' had labelled class 1
    ("bg\n1 cell\n2 debris\n  \n", ["bg", "1 cell", "2 debris"]),  # not all numbered: names as written
    ("10 cm\n20 cm\n30 cm\n", ["10 cm", "20 cm", "30 cm"]),  # numbers beyond the classes: no indices
    ("0 cm\n10 cm\n20 cm\n", ["0 cm", "10 cm", "20 cm"]),  # most numbers beyond them: still no indices
    ("1 bg\n2 cell\n3 debris\n", ["1 bg", "2 cell", "3 debris"]),  # 1-based: in line order, as written
    ("__ignore__\n_background_\ncell\ndebris\n", ["_background_", "cell", "debris"]),  # labelme's labels.txt
])
def test_lines_numbered_with_their_class_index_are_read_as_the_names(tmp_path, text, names):
    """'0 background' (as some label tools write their lists) became the name '0 background', its column
    val_iou_0_background."""
    (tmp_path / "class_names.txt").write_text(text)
    assert load_class_names({"data_dir": str(tmp_path), "num_classes": 3}) == names
    (tmp_path / "class_names.txt").write_text("1 road\n")
    assert load_class_names({"data_dir": str(tmp_path), "num_classes": 1}) == ["road"]


def test_a_class_named_mean_is_not_taken_for_the_mean_row():
    """A class named 'mean' printed a second 'mean' row above the mean of all classes."""
    names = ["bg", "mean", "cell"]
    row = {"val_iou": 0.5, "val_dice": 0.6, **{f"val_iou_{n}": 0.1 * i for i, n in enumerate(names)},
           **{f"val_dice_{n}": 0.2 * i for i, n in enumerate(names)}}
    lines = [line.split() for line in train_unet.per_class_table(row, names).splitlines()[1:]]
    assert [line[0] for line in lines] == ["bg", "mean", "cell", "(mean)"] and lines[-1][1:] == ["0.5000", "0.6000"]
    assert train_unet.per_class_table(row | {"val_iou_mean": 0, "val_dice_mean": 0, "val_iou_x": 0.1, "val_dice_x": 0},
                                      ["bg", "x", "cell"]).splitlines()[-1].split()[0] == "mean"


@pytest.mark.parametrize("text, match", [
    ("background\nbox\n", r"has 2 line\(s\) but num_classes=3 needs 3: one class name per line"),
    ("background\n\nbox\n", r"class_names.txt: line 2 is blank: one class name per line, class 0 first \(remove "
                             r"the line, or name the class, e.g. unused_1\)"),
    ("0 bg\n1 cat\n1 dog\n", r"class_names.txt numbers its lines 0, 1, 1: a line's number is its class index "
                            r"\(the mask value\), each of 0 to 2 once: number them so, or give the names alone"),
    ("0 bg\n1 cat\n3 fish\n", r"numbers its lines 0, 1, 3: .* each of 0 to 2 once"),  # 'fish' had named class 2
    ("a\nA b\na\n", "a name of its own once spaces and punctuation become _"),
    ("cell A\ncell_A\nbox\n", r"\('cell_A', 'cell_A', 'box'\)|'cell_A', 'cell_A', 'box'"),  # the same once sanitised
])
def test_bad_class_names_file_is_a_one_line_error(make_cfg, multi_data, text, match, capsys):
    (multi_data / "class_names.txt").write_text(text)
    with pytest.raises(UserError, match=match):
        load_class_names({"data_dir": str(multi_data), "num_classes": 3})
    code = train_unet.main([f"data_dir={multi_data}", "num_classes=3", "image_size=64", "epochs=1",
                            "batch_size=4", "device=cpu", "progress=False",
                            f"checkpoint_dir={make_cfg()['checkpoint_dir']}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_a_class_names_folder_is_refused_not_taken_as_no_file(multi_data):
    """A folder named class_names.txt (a zip's unpacking) was taken as no file: the names silently the indices."""
    (multi_data / "class_names.txt").mkdir()
    with pytest.raises(UserError, match=r"^.*class_names\.txt is a folder: class names are a text file, one name per "
                                        r"line, class 0 first: put that file in its place, or remove it$"):
        load_class_names({"data_dir": str(multi_data), "num_classes": 3})


def test_the_table_says_when_a_class_absent_from_the_val_set_was_predicted():
    """A class in no validation mask but predicted has IoU 0 and counts in the mean: the table printed a bare
    0.0000 for it, while one neither held nor predicted read 'absent from the val set'."""
    names = ["bg", "cell", "debris", "dust"]
    row = {"epoch": 2, "val_loss": 0.7, "val_iou": 0.4, "val_dice": 0.5,
           **{f"val_iou_{n}": v for n, v in zip(names, (0.9, 0.0, 0.0, math.nan))},
           **{f"val_dice_{n}": v for n, v in zip(names, (0.95, 0, 0, math.nan))}}
    confusion = [[90, 5, 5, 0], [10, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]  # rows: true class; debris, dust in none
    run = type("Run", (), {"history": [row], "class_names": names, "confusion": confusion})
    lines = dict(line.split(None, 1) for line in train_unet.end_of_run_table(run).splitlines()[2:])
    assert lines["cell"] == "0.0000  0.0000"  # in the masks, never found: a plain 0
    assert lines["debris"] == "0.0000  0.0000  absent from the val set but predicted: 0 in the mean"
    assert lines["dust"] == "absent from the val set"


def test_the_table_and_the_notebook_name_the_epoch_best_pt_holds_not_a_non_finite_one():
    """nan_guard=False keeps an epoch whose val loss is NaN, never as best.pt; the end-of-run table ("at the best
    epoch") and my_run.ipynb's "best val IoU ... at epoch" picked it all the same where its IoU was the highest."""
    names = ["bg", "cell"]

    def row(epoch, loss, iou):
        return {"epoch": epoch, "val_loss": loss, "val_iou": iou, "val_dice": iou,
                **{f"val_{m}_{n}": iou for m in ("iou", "dice") for n in names}}
    history = [row(1, 0.9, 0.5), row(2, 0.8, 0.6), row(3, math.nan, 0.7), row(4, 0.7, 0.6)]
    run = type("Run", (), {"history": history, "class_names": names, "confusion": [[5, 1], [1, 5]]})
    assert "at the best epoch (2)" in train_unet.end_of_run_table(run)  # the first of the highest finite: 2, not 4
    read_back = list(csv.DictReader(io.StringIO(train_unet.history_text(history))))  # the notebook's rows: strings
    assert train_unet.best_epoch_row(read_back)["epoch"] == "2"
    assert train_unet.best_epoch_row([row(1, math.inf, 0.4), row(2, math.nan, 0.5)]) is None


def test_the_num_classes_hint_counts_class_names_as_they_are_read(tmp_path):
    """labelme's labels.txt (__ignore__, _background_, cat, dog): the data check's hint said num_classes=4, which
    class_names.txt, read without __ignore__, then refused ('has 3 line(s) but num_classes=4 needs 4')."""
    (tmp_path / "class_names.txt").write_text("__ignore__\n_background_\ncat\ndog\n\n")
    cfg = {"data_dir": str(tmp_path), "num_classes": 2}
    assert train_unet.set_classes([{0, 1, 2}], cfg) == 3
    assert load_class_names({**cfg, "num_classes": 3}) == ["_background_", "cat", "dog"]
