"""`fomoe plan --measure` against `fomoe generate` on this machine: the projection beside the run it projects.

On the bench model of bench/decode.py (`--shape bench`, its expert store beside it), cpu backend, host
tier at `--ram-frac` of the experts, `-t THREADS`, each round runs, one right after the other:

    fomoe generate MODEL --store STORE --vram-cache 0 --ram-cache BYTES -t THREADS -n TOKENS --ignore-eos -p The --seed ROUND
    fomoe plan MODEL --hardware cpu-only-64g --measure STORE --hit-rates DEVICE,HOST,DISK -t THREADS --json
    fomoe generate ...   (the same run again)

the plan with the hit rates the first run printed, and compares its projected tok/s with the two runs'
(their tokens over their time: the runs bracket the measurement, so a drive that speeds up or slows down
across the round moves both sides alike; the two runs decode the same tokens from the same cold tiers,
with the same seed, so their hit rates are the same, which the round checks). `--measure` takes every figure of this
machine anew each round (the drive as the engine reads the store, the host's time per layer step, the
slot fills, the products, the model's own predictions): a virtual disk's rate moves by half within
minutes here, so a projection is only checked against runs made in the same minute. Prints each round
and the median of the rounds' errors; beside the drive figure, the rate each run's own disk reads came at
(the bytes the kernel read for it over its decode's time: a floor, since its reads are not in flight all
the time), which tells a drive figure that missed the runs' minute from a schedule that misprojects them.

    python bench/plan_measure.py [--rounds 5] [--tokens 96] [--threads 2] [--ram-frac 0.25] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
from datetime import date
from pathlib import Path

import numpy as np
from decode import ensure_model
from results import load_line, processor, publish

from fomoepy.experts.store_reader import ExpertStore

GENERATED = re.compile(r"generated (\d+) tokens \(([\d.]+) tok/s\)")
# "experts: 6144 uses; device 45.2% hit, host off, disk 54.8% (...)": each tier's share of the uses
SHARE = re.compile(r"(device|host) (?:([\d.]+)% hit|off)")
DISK = re.compile(r"disk ([\d.]+)%")
LANDED = re.compile(r"(\d+) of them landed before it asked")


def fomoe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fomoepy.cli", *args], capture_output=True, text=True, check=True)


def generate(model: Path, store: Path, ram: int, threads: int, tokens: int, seed: int) -> tuple[float, tuple[float, float, float], int, float]:
    """(tok/s, (device, host, disk) shares of the expert uses in percent, reads made ahead that landed before
    their step asked, the bytes/s its own disk reads came at over its decode) of one `fomoe generate` run; the
    same seed samples the same tokens, so two runs with it route alike. The last is the bytes the kernel read
    from the disk for the run (its file system inputs, as `time -v` counts them: O_DIRECT's too) over its decode's
    time: a floor of the rate its reads got, to set beside the drive figure `--measure` takes in the minute after."""
    blocks = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    err = fomoe("generate", str(model), "--store", str(store), "--vram-cache", "0", "--ram-cache", str(ram), "-t", str(threads),
                "-n", str(tokens), "--ignore-eos", "-p", "The", "--seed", str(seed)).stderr  # fmt: skip
    speed = GENERATED.search(err)
    line = next((ln for ln in err.splitlines() if "experts:" in ln), "")
    shares = {tier: float(pct) if pct else 0.0 for tier, pct in SHARE.findall(line)}
    disk = DISK.search(line)
    landed = LANDED.search(err)
    if speed is None or disk is None or landed is None or set(shares) != {"device", "host"}:
        raise SystemExit(f"could not read the run's speed, hit rates and reads ahead from:\n{err}")
    read = 512 * (resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - blocks)  # (inputs are counted in 512-byte blocks)
    tok_s = float(speed.group(2))
    return tok_s, (shares["device"], shares["host"], float(disk.group(1))), int(landed.group(1)), read / (tokens / tok_s)


def plan(model: Path, store: Path, shares: tuple[float, float, float], threads: int) -> dict:
    hit_rates = ",".join(f"{s:.1f}" for s in shares)
    return json.loads(fomoe("plan", str(model), "--hardware", "cpu-only-64g", "--measure", str(store), "--hit-rates", hit_rates,
                            "-t", str(threads), "--json").stdout)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96, help="tokens each generate run decodes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ram-frac", type=float, default=0.25, help="host tier, as a share of the experts' bytes")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    model, store = ensure_model("bench")
    with ExpertStore.open([store], model) as s:
        experts = sum(layer.expert_nbytes for layer in s.layers) * s.manifest.layers[0].n_expert
    ram = int(args.ram_frac * experts)
    rows, errors = [], []
    for r in range(args.rounds):
        before, shares, landed_before, read_before = generate(model, store, ram, args.threads, args.tokens, seed=r + 1)
        out = plan(model, store, shares, args.threads)
        after, shares_after, landed_after, read_after = generate(model, store, ram, args.threads, args.tokens, seed=r + 1)
        if shares_after != shares:
            raise SystemExit(f"round {r + 1}: the two runs' hit rates differ ({shares} and {shares_after}): not the same run")
        measured = 2 / (1 / before + 1 / after)  # the two runs' tokens over their time
        projected = out["projection"]["tokens_per_s"]
        drive = out["hardware"]["drives"]["bandwidth"]
        host = out["hardware"]["host"]["plan"]
        ahead = out["prefetch"]["share"]
        steps = args.tokens * out["model"]["n_layer"]  # (the projection's figure is per layer step, every layer's)
        landed = (landed_before / steps, landed_after / steps, out["projection"]["landed_ahead"])
        errors.append(projected / measured - 1)
        rows.append(f"| {r + 1} | {before:.2f}, {after:.2f}: {measured:.2f} | {shares[0]:.1f} / {shares[1]:.1f} / {shares[2]:.1f} | {projected:.2f} "
                    f"| {100 * errors[-1]:+.1f} % | {drive / 1e9:.2f} | {read_before / 1e9:.2f}, {read_after / 1e9:.2f} | {host * 1e6:.0f} | {100 * ahead:.0f} % "
                    f"| {landed[0]:.2f}, {landed[1]:.2f} / {landed[2]:.2f} |")  # fmt: skip
        print(rows[-1], file=sys.stderr)
    median = float(np.median(errors))
    worst = max(errors, key=abs)
    report = (
        f"### plan_measure — {date.today()} — {platform.machine()}, {os.cpu_count()} cores ({processor()}) — {load_line()}\n\n"
        f"`python bench/plan_measure.py --rounds {args.rounds} --tokens {args.tokens} --threads {args.threads} "
        f"--ram-frac {args.ram_frac}`: bench model, cpu backend, host tier {args.ram_frac:.0%} of the experts "
        f"({ram / 2**20:.0f} MiB), -t {args.threads}; each round a `fomoe generate` run, then `fomoe plan --measure` with its hit "
        "rates (every figure of this machine measured anew in that round), then the same run again: the projection against "
        "the two runs' tokens over their time\n\n"
        "| round | generate tok/s (before, after: both) | hit rates device / host / disk % | plan --measure tok/s | projected vs measured "
        "| drive GB/s (as the engine reads the store) | the runs' own disk reads, GB/s over their decode (a floor) "
        "| host µs per layer step | misses read ahead | reads ahead landed before their step, a layer step: runs / projected |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"Median error {100 * median:+.1f} %, largest {100 * worst:+.1f} % (over {args.rounds} rounds).\n"
    )  # fmt: skip
    return publish(report, args.record)


if __name__ == "__main__":
    sys.exit(main())
