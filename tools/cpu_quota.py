"""torch's threads under a CPU quota: a training step with torch's default thread count (the cores of the
CPU affinity) against the count train_unet fits to the quota (fit_cpu_threads), side by side.

Run it inside the quota you train under, e.g.
    docker run --cpus=1 ... python tools/cpu_quota.py
    systemd-run --scope -p CPUQuota=100% .venv/bin/python tools/cpu_quota.py
Each round times STEPS training steps (smp.Unet resnet18, 128 px, batch 4, fp32) in a fresh process for
each thread count, alternating; the table gives the medians over rounds.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHILD = """
import sys, time, statistics, torch
import segmentation_models_pytorch as smp
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
model = smp.Unet("resnet18", encoder_weights=None, classes=1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(4, 3, 128, 128), torch.rand(4, 1, 128, 128)
times = []
for _ in range(int(sys.argv[2]) + 2):  # two warm-up steps
    start = time.perf_counter()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - start)
print(statistics.median(times[2:]))
"""


def step_seconds(threads, steps):
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(steps)], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.split()[-1])


def main():
    import torch

    import train_unet as T

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    default = torch.get_num_threads()
    note = T.fit_cpu_threads()
    fitted = torch.get_num_threads()
    print(f"CPU quota {T.cpu_quota():g} core(s) of the {len(os.sched_getaffinity(0))} in the CPU affinity; "
          f"torch default {default} thread(s), fitted {fitted}")
    print(f"fit_cpu_threads: {note or 'no change'}")
    counts = sorted({default, fitted}, reverse=True)
    times = {n: [] for n in counts}
    start = time.perf_counter()
    for _ in range(args.rounds):
        for n in counts:
            times[n].append(step_seconds(n, args.steps))
    print(f"\n{'threads':>8} {'s/step (median)':>16} {'rounds':>7} {'vs default':>11}")
    base = statistics.median(times[default])
    for n in counts:
        median = statistics.median(times[n])
        print(f"{n:>8} {median:>16.3f} {len(times[n]):>7} {base / median:>10.2f}x  per round: "
              + " ".join(f"{t:.3f}" for t in times[n]))
    print(f"\n{args.rounds} rounds x {args.steps} steps in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
