"""Freed memory kept for reuse (keep_freed_memory): glibc's malloc otherwise gives large freed blocks back
to the kernel, and every CPU forward faults its activations in again. Counted (minor page faults), not timed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import train_unet

ROOT = Path(__file__).resolve().parents[1]
GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")

FAULTS = """
import json, resource, sys, torch
sys.path.insert(0, {root!r})
import train_unet
kept = train_unet.keep_freed_memory() if sys.argv[1] == "keep" else None
torch.set_num_threads(1)
cfg = train_unet.validate_config(dict(train_unet.CONFIG, image_size=64, encoder_name="resnet18"))
torch.manual_seed(0)
model, x = train_unet.build_model(cfg).eval(), torch.randn(8, 3, 128, 128)
faults = []
with torch.inference_mode():
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(x)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"kept": kept, "faults": faults}}))
"""


def forward_faults(mode, **env):
    """(keep_freed_memory's answer, minor page faults of each of 6 forwards) in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k not in train_unet.MALLOC_TUNING_ENV} | env
    out = subprocess.run([sys.executable, "-c", FAULTS.format(root=str(ROOT)), mode], env=env, check=True,
                         capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["kept"], result["faults"]


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc parameters: other C libraries keep their own policy")
def test_forwards_stop_faulting_their_memory_in_once_freed_memory_is_kept():
    """Without it a forward faults in thousands of pages (4 kB each) again whenever glibc maps its blocks
    afresh; with it, once the heap has grown to the forward's size, the forwards reuse its memory: a few
    late growths, most forwards none."""
    # glibc's own threshold moves with the process's history: on some machines this small forward settles
    # after two forwards (6,000-67,000 faults over the five, 11-25), on others it never does (47,000-112,000).
    # The baseline holds it at its starting 128 kB, the state before it has moved, so the test can fail
    _, plain = forward_faults("plain", MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    kept, reused = forward_faults("keep")
    assert kept is True
    # after the first forward (measured: 530,000 against 1,000-9,000 over the five)
    assert sum(plain[1:]) > 20000, plain
    assert sum(reused[1:]) < sum(plain[1:]) / 4, (reused, plain)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc parameters")
def test_a_users_own_malloc_tuning_wins():
    kept, _ = forward_faults("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert kept is False


def test_every_command_of_the_script_keeps_freed_memory(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(train_unet, "keep_freed_memory", lambda: calls.append(1))
    assert train_unet.main(["no_such_command"]) == 2  # set before the command is even parsed
    assert calls == [1] and "unknown command" in capsys.readouterr().err


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc parameters")
def test_the_memory_reuse_tool_prints_both_sides(capsys):
    """tools/memory_reuse.py (BENCHMARKS.md "Memory kept for reuse"), on a small fp32 window: a row for each
    side, each from its own process, whose child asserts that the setting applied on its side (kept) or not
    (default). Which side faults less is the first test's to say, against a baseline held at one threshold:
    here glibc's default side moves its own threshold with the process's history, and under a concurrent
    suite one run read 61,446 faults kept against 32,738 default (alone: 2,500-55,000 against 100,000-344,000)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import memory_reuse
    # 512 px: 9 tiles, 3 forwards a pass, enough to count on each side (no longer a contest: smaller is faster)
    assert memory_reuse.main(["work=window", "rounds=1", "size=512", "image_size=256", "tile_batch_size=4",
                              "use_amp=False", "channels_last=False"]) == 0  # a child whose check failed raises
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| window")]
    faults = {row[2].strip(): int(row[4].strip().replace(",", "")) for row in rows}
    assert set(faults) == {"glibc default", "kept for reuse"}
    # zero is a true reading on the kept side (its forward reused every page; one full-suite run read 0)
    assert all(n >= 0 for n in faults.values()), faults
    assert all(float(row[3]) > 0 and float(row[6].split()[0]) > 0 for row in rows), rows  # time and peak memory
