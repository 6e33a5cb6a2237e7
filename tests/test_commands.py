"""The commands as a user runs them: one end-to-end chain, torchrun, and one test per family of failure
(the line names the file or key, no traceback, nothing written or lost)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np

from conftest import ROOT, as_args, cli
from unet_amp import checkpoint


def one_clear_line(result, code, *names):
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert all(name in last for name in names), last


def test_train_predict_export_onnx_chain(tiny, tmp_path, shapes):
    assert cli(*as_args({**tiny, "use_amp": False, "tta": "flip"})).returncode == 0
    best = Path(tiny["checkpoint_dir"]) / "best.pt"
    out_torch, out_onnx = tmp_path / "torch", tmp_path / "onnx"
    assert cli("predict", f"checkpoint={best}", f"input={shapes / 'images'}", f"output={out_torch}",
               "amp=fp32").returncode == 0  # onnxruntime runs fp32
    assert cli("export", f"checkpoint={best}", f"output={tmp_path / 'deploy'}").returncode == 0
    assert cli("predict", "backend=onnxruntime", f"checkpoint={tmp_path / 'deploy'}", f"input={shapes / 'images'}",
               f"output={out_onnx}").returncode == 0
    masks = sorted(out_torch.glob("*.png"))
    assert len(masks) == len(list((shapes / "images").iterdir()))
    same = [np.mean(cv2.imread(str(m), 0) == cv2.imread(str(out_onnx / m.name), 0)) for m in masks]
    assert min(same) > 0.999


def test_a_bad_key_or_value_is_one_line_and_exit_2(tiny):
    one_clear_line(cli(*as_args(tiny), "epochs=zero"), 2, "epochs")
    one_clear_line(cli(*as_args(tiny), "batchsize=4"), 2, "batchsize")
    assert not Path(tiny["checkpoint_dir"]).exists()


def copy_of(shapes, data, n=10):
    """The first n pairs of the shapes data set, to spoil."""
    for sub in ("images", "masks"):
        (data / sub).mkdir(parents=True)
        for f in sorted((shapes / sub).iterdir())[:n]:
            (data / sub / f.name).write_bytes(f.read_bytes())
    return data


def test_an_unreadable_image_is_one_line_naming_it_and_nothing_is_written(tiny, shapes, tmp_path):
    data = copy_of(shapes, tmp_path / "data")
    broken = sorted((data / "images").iterdir())[3]
    broken.write_bytes(b"not a png")
    one_clear_line(cli(*as_args({**tiny, "data_dir": data})), 2, broken.name)
    assert not (Path(tiny["checkpoint_dir"]) / "last.pt").exists()


def test_an_unpaired_file_is_one_line_naming_it(tiny, shapes, tmp_path):
    data = copy_of(shapes, tmp_path / "data")
    lone = sorted((data / "masks").iterdir())[0]
    (data / "images" / lone.name).unlink()
    one_clear_line(cli(*as_args({**tiny, "data_dir": data})), 2, lone.stem)


def test_an_os_limit_is_one_line_and_leaves_no_half_written_checkpoint(tiny):
    def small_files():  # ulimit -f: writes past 1 MB fail with EFBIG (the signal ignored, as a shell does)
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
    result = subprocess.run([sys.executable, str(ROOT / "train_unet.py"), *as_args({**tiny, "use_amp": False})],
                            cwd=ROOT, text=True, capture_output=True, timeout=300, preexec_fn=small_files)
    one_clear_line(result, 2, "last.pt")
    assert not list(Path(tiny["checkpoint_dir"]).glob("*.pt")) and not list(Path(tiny["checkpoint_dir"]).glob(".*.tmp"))


def start(args, **kw):
    return subprocess.Popen([sys.executable, str(ROOT / "train_unet.py"), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def wait_for(path, proc, seconds=240):
    deadline = time.time() + seconds
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)


def test_kill_9_then_resume_finishes_the_run(tiny):
    cfg = {**tiny, "use_amp": False, "epochs": 2, "max_train_images": 8}
    last = Path(cfg["checkpoint_dir"]) / "last.pt"
    proc = start(as_args(cfg))
    wait_for(last, proc)
    proc.kill()
    proc.wait()
    assert checkpoint.load_checkpoint(last)["epoch"] >= 1  # whole: written under a temporary name, then renamed
    assert cli("resume=True", f"checkpoint_dir={cfg['checkpoint_dir']}").returncode == 0
    assert checkpoint.load_checkpoint(last)["epoch"] == 2


def test_ctrl_c_stops_with_one_line_and_exit_130(tiny):
    cfg = {**tiny, "use_amp": False, "epochs": 50, "max_train_images": 8}
    proc = start(as_args(cfg))
    wait_for(Path(cfg["checkpoint_dir"]) / "last.pt", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err and "resume=True" in err.strip().splitlines()[-1]
    checkpoint.load_checkpoint(Path(cfg["checkpoint_dir"]) / "last.pt")


def test_torchrun_two_processes_train_one_run(tiny):
    cfg = {**tiny, "use_amp": False, "max_train_images": 8, "batch_size": 2}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
                          str(ROOT / "train_unet.py"), *as_args(cfg)], cwd=ROOT, text=True, capture_output=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("done:") == 1  # rank 0 alone reports
    assert checkpoint.load_checkpoint(Path(cfg["checkpoint_dir"]) / "last.pt")["epoch"] == 1


def test_outputs_are_readable_as_the_umask_says(tiny):
    assert cli(*as_args({**tiny, "use_amp": False, "max_train_images": 8}), env={}).returncode == 0
    mode = (Path(tiny["checkpoint_dir"]) / "last.pt").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask
