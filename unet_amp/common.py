"""What every module shares: the user's error, atomic writes, and the run-a-command wrapper."""
from __future__ import annotations

import errno
import io
import json
import os
import sys
import tempfile
from pathlib import Path

UMASK = os.umask(0o022)
os.umask(UMASK)  # read once: the process's umask, for the files atomic_write makes
IGNORE_INDEX = 255  # mask value that no loss or metric counts: void, padding
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
MASK_EXTS = (".png", ".tif", ".tiff", ".bmp")  # JPEG's lossy blocks would invent class values


class UserError(Exception):
    """A mistake the user can fix: printed as one line ('error: ...'), exit code 2, no traceback."""


def say(*args, **kwargs):
    """print, on rank 0 only (under torchrun every process runs the same code)."""
    if os.environ.get("RANK", "0") == "0":
        print(*args, **kwargs, flush=True)


def atomic_write(path, write):
    """write(tmp) into a temporary file beside `path`, then rename it over `path`: a reader (or a kill -9)
    sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~UMASK)  # as open() would make it: mkstemp's 0600 hid outputs from other users
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # on the disk before the rename: a power cut leaves the old file, not an empty one
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):  # named as the file the user knows, not its temporary name
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    return path


def atomic_save_torch(obj, path):
    """torch.save into memory, then an ordinary write: a full disk is an OSError, not torch's RuntimeError."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(buffer.getbuffer()))


def atomic_write_text(path, text):
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_json(path, obj):
    return atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


# errno -> (cause, fix) for the OS limits a run meets: one line each, nothing lost (writes are atomic)
OS_LIMITS = {
    errno.ENOSPC: ("the disk is full", "free some space and run again"),
    errno.EDQUOT: ("the disk quota is used up", "free some space and run again"),
    errno.EACCES: ("permission denied", "choose a folder you can write to"),
    errno.EPERM: ("operation not permitted", "choose a folder you can write to"),
    errno.EROFS: ("the file system is read-only", "choose a folder you can write to"),
    errno.EMFILE: ("too many open files", "raise the limit (ulimit -n) or use fewer num_workers"),
    errno.EFBIG: ("the file-size limit was reached", "raise it (ulimit -f unlimited)"),
}


def run_guarded(command, stopped="files written so far are complete"):
    """Run command() and return its exit code; each family of failure ends in one line on stderr:
    a user's mistake (2), an OS limit or out of memory (2), a stop by Ctrl-C or SIGTERM (130)."""
    try:
        return command() or 0
    except UserError as exc:
        _tell(f"error: {exc}")
        return 2
    except OSError as exc:
        if exc.errno not in OS_LIMITS:
            raise
        cause, fix = OS_LIMITS[exc.errno]
        _tell(f"error: {exc.filename or 'a file'}: {cause}; {fix} (nothing written was left half-done)")
        return 2
    except (MemoryError, RuntimeError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
        if not isinstance(exc, MemoryError) and "out of memory" not in str(exc):
            raise
        _tell("error: out of memory: use a smaller batch_size or image_size (accumulation_steps keeps the "
              "effective batch), or preset=low_memory; checkpoints written so far are intact")
        return 2
    except KeyboardInterrupt as exc:
        _tell(f"stopped: {exc.args[0] if exc.args else stopped}")
        return 130


def _tell(line):
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
