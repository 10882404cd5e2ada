"""Time per decoded token: the bytes a layer step moves, divided by the rates that move them,
combined the way a schedule overlaps them.

Work per MoE layer step for one token (k = experts used, S = bytes of one expert):

    dense     dense weights read by the kernels          dense_bytes / (bandwidth x eff["dense"]); reading
                                                         ahead, the next layer's router too (the prediction)
    experts   k expert FFNs on the compute device        k x compute_bytes / (bandwidth x eff["experts"])
    sync      read back the router's choice              device.sync (GPU), 0 on the CPU
    plan      host bookkeeping of the step               host.plan
    disk      k x disk share reads of S bytes            spread over the drives (engine) or one queue (FOMOE)
    copy      k x (host + disk share) x S to the device  over the link (GPU) or make-ready (CPU backend)
    demote    k x demoted share x S to the host          over the link's other direction, beside the copies up (GPU, engine schedule)
    fill      k x disk share x fill share x S            host.fill: the cpu (ggml) backend sets the misses its tier keeps
              set into tier slots                        into slots (0: none); host.fill_share of them

Two schedules combine them:

  engine  (what fomoepy does, DESIGN.md "data path of one decoded token")
          dense -> sync -> plan -> a demoting policy's device evictees copied down on a stream of their own
          (not waited for; a GPU's copy engines move them beside the copies up, the link's two
          directions at once; the next step's copies up wait for them) -> all the layer's misses read
          at once, striped across the drives
          (one latency, then bytes / (drives x bandwidth)); each miss copied up on the copy stream
          as soon as its read lands, so the fetch is max(disk, copy) plus the last read's copy, while
          the device computes the experts already resident (launched before any wait on a copy, once
          the step's reads are issued: `[host] before_launch` after the routing, when those at hand are
          copied up too), and copies up the reads from its plan on (`[host] before_copies`); the copied
          experts' FFNs follow the last copy. The next layer's guessed experts are read ahead
          in the drives' time left after the step's own reads (ReadAheadModel). The CPU backends compute on the host: the numpy reference reads, makes ready and
          computes in turn (every term adds up); ggml computes the experts whose store bytes are in
          the host tier while the misses are read, then the misses.
  fomoe   (FOMOE's published design) dense -> router round trip -> each NVMe read in turn, full
          stride, its latency each time; the link copies run beside the reads; then all k FFNs.
          Layers alternate GPUs, so nothing of one layer overlaps the next.

The bound under perfect overlap is the busiest single resource (device, link, drives, host); the
drives' share is their bytes at their bandwidth, every drive at once, no latency in series.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from math import comb

from fomoepy.errors import FomoeError
from fomoepy.experts.read_ahead import DEPTH_PER_DRIVE
from fomoepy.plan.hardware import Hardware
from fomoepy.plan.rates import TierRates
from fomoepy.plan.shapes import ModelBytes

SCHEDULES = ("engine", "fomoe")
# FOMOE's host bookkeeping per MoE layer step, for its schedule: its C code was not measured here; this
# is the figure its published efficiency was fitted with (bench/plan_fomoe.py). Our own schedule takes
# the hardware file's `plan`, which is fomoepy's host time, measured (bench/host_time.py).
FOMOE_HOST_PLAN = 40e-6
TERMS = ("dense", "experts", "head", "sync", "plan", "disk", "copy", "demote", "fill")
# Fraction of device memory bandwidth the kernels reach, per kernel family. The GPU default is the one
# constant fitted to FOMOE's published CAR 0.35 figure on its RDNA4 rig (see fit_efficiency); it is a
# stand-in until our own kernels are timed on a GPU. The CPU backend's rates are measured, hence 1.
GPU_EFFICIENCY = 0.36
CPU_EFFICIENCY = 1.0


@dataclass(frozen=True)
class Workload:
    """Bytes of one token's decode, in the forms the schedule moves and computes them."""

    model: ModelBytes
    compute_expert_bytes: int = 0  # the expert as the kernels read it (0: the stored bytes)
    compute_dense_bytes: int = 0  # a layer's dense weights as the kernels read them (0: stored)
    compute_head_bytes: int = 0

    @property
    def expert_compute(self) -> int:
        return self.compute_expert_bytes or self.model.expert_bytes

    @property
    def dense_compute(self) -> int:
        return self.compute_dense_bytes or self.model.dense_layer_bytes

    @property
    def head_compute(self) -> int:
        return self.compute_head_bytes or self.model.head_bytes


@dataclass(frozen=True)
class Projection:
    schedule: str
    backend: str  # gpu | cpu
    seconds_per_token: float
    terms: dict  # busy seconds per token per term, before overlap
    waits: float  # seconds per token the compute side sits waiting for data
    bound_seconds: float  # busiest resource: perfect overlap
    bound_resource: str
    prefill_tokens_per_s: float
    efficiency: dict = field(default_factory=dict)
    prefill_flops_modelled: bool = False  # False: the hardware states no flops, prefill is bytes bound
    host_serial: float | None = None  # per token, of terms["plan"]: in series with the reads (None: all of it)
    wrong_reads: float = 0.0  # per token, the drives' time on wrong guesses read ahead (in their idle time)
    landed_ahead: float = 0.0  # per layer step, right guesses read ahead that land before their step asks

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.seconds_per_token

    def as_dict(self) -> dict:
        out = asdict(self)
        out["tokens_per_s"] = self.tokens_per_s
        out["bound_tokens_per_s"] = 1.0 / self.bound_seconds
        return out


def _rate(value: float, what: str) -> float:
    if value <= 0:
        raise FomoeError(f"the hardware file gives no {what}; the projection needs it")
    return value


def project(
    work: Workload,
    hw: Hardware,
    rates: TierRates,
    schedule: str = "engine",
    *,
    efficiency: dict | None = None,
    prefetch: float = 0.0,
    by_rank: tuple[float, ...] = (),
    drop: frozenset[str] = frozenset(),
    prefill_tokens: int = 512,
    devices_per_layer: int = 1,
    vary: bool = True,
) -> Projection:
    """Seconds per decoded token. `drop` zeroes named terms (to see what each one costs);
    `prefetch` is the share of next-layer misses read ahead while a step computes (it hides at
    most that step's compute), `by_rank` the predictor's accuracy by position (the engine reads its most
    confident guesses first: ReadAheadModel); `devices_per_layer` splits every layer's experts over that many GPUs,
    each computing its share and copying over its own link (the engine places whole layers: 1).
    The engine schedule's step is averaged over how many misses a step has (`vary`, _over_misses);
    with vary False, and for FOMOE's schedule (as its published figures were fitted), the step at the
    average tier shares."""
    if vary and schedule == "engine" and 0.0 < rates.disk < 1.0 and "disk" not in drop:
        return _over_misses(work, hw, rates, efficiency=efficiency, prefetch=prefetch, by_rank=by_rank, drop=drop,
                            prefill_tokens=prefill_tokens, devices_per_layer=devices_per_layer)  # fmt: skip
    if schedule not in SCHEDULES:
        raise FomoeError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if not 1 <= devices_per_layer <= max(1, hw.device.count):
        raise FomoeError(f"cannot split a layer over {devices_per_layer} devices: the hardware has {hw.device.count}")
    m = work.model
    gpu = hw.device.count > 0
    eff = {"dense": GPU_EFFICIENCY if gpu else CPU_EFFICIENCY, "experts": GPU_EFFICIENCY if gpu else CPU_EFFICIENCY}
    eff.update(efficiency or {})
    if gpu:
        compute_rate = _rate(hw.device.bandwidth, "device bandwidth")
        copy_rate = _rate(hw.device.link, "device link bandwidth")
        flop_rate = hw.device.flops
    else:
        compute_rate = _rate(hw.host.matvec, "host matvec throughput")
        copy_rate = hw.host.make_ready  # 0: the CPU backend computes on store bytes in place
        flop_rate = hw.host.flops
    k = m.n_expert_used
    S = m.expert_bytes
    n_disk = k * rates.disk
    n_copy = k * (rates.host + rates.disk)
    drives = hw.drives
    if n_disk > 0 or rates.ahead > 0:
        _rate(drives.bandwidth, "drive bandwidth")
    # reading ahead, the engine predicts the next layer's experts on every decode step with that layer's
    # router (MoEStep.predicts): the device reads the router's bytes once more
    predicts = gpu and schedule == "engine" and (prefetch > 0 or rates.ahead > 0) and "disk" not in drop
    layer = {
        "dense": (work.dense_compute + (m.router_bytes if predicts else 0)) / (compute_rate * eff["dense"]),
        "experts": k * work.expert_compute / (compute_rate * eff["experts"]),
        "sync": hw.device.sync if gpu else 0.0,
        # the hardware file's host time is fomoepy's, measured; FOMOE's C host code has its own (stated)
        "plan": FOMOE_HOST_PLAN if schedule == "fomoe" else hw.host.plan,
        "disk": 0.0,
        "copy": n_copy * S / copy_rate if copy_rate else 0.0,
        # FOMOE's tiers are its own (no demotion); a CPU backend has no device tier to demote from
        "demote": k * rates.demoted * S / copy_rate if gpu and schedule == "engine" else 0.0,
        # the cpu (ggml) backend sets the misses its tier keeps into tier slots (in their form) once the step's
        # reads have landed; a decode step computes the others where their reads landed
        "fill": n_disk * hw.host.fill_share * S / hw.host.fill if not gpu and not copy_rate and hw.host.fill else 0.0,
    }
    if schedule == "fomoe":
        layer["disk"] = n_disk * (drives.latency + S / drives.bandwidth) if n_disk else 0.0
    elif n_disk:
        lanes = max(1, min(drives.count, round(n_disk + 0.5)))
        layer["disk"] = drives.latency + n_disk * S / (drives.bandwidth * lanes)
    head = work.head_compute / (compute_rate * eff["dense"])
    layer["experts"] /= devices_per_layer
    layer["copy"] /= devices_per_layer
    layer = {name: (0.0 if name in drop else t) for name, t in layer.items()}
    head = 0.0 if "head" in drop else head

    one_ffn = layer["experts"] / k
    host, serial, launch, copies = layer["plan"], None, None, None
    if gpu and schedule == "engine" and hw.host.serial is not None:
        serial = min(hw.host.serial, host)
    # the host's time from the routing until the step's reads are issued (the next layer's guesses follow them)
    in_series = host if serial is None else serial
    before = in_series if hw.host.before_reads is None else min(in_series, hw.host.before_reads)
    if serial is not None and hw.host.before_launch is not None:
        launch = min(hw.host.before_launch, host)
        # a read's copy up starts once the plan has said which slot it fills (the device's part of the
        # step after the plan), which may come after the first launch (the experts the device holds,
        # and the copies of those at hand, go first)
        copies = launch if hw.host.before_copies is None else max(launch, min(hw.host.before_copies, host))
    if schedule == "fomoe":
        fetch = max(layer["disk"], layer["copy"])  # the link copies run beside the reads
        hidden = min(prefetch * fetch, layer["dense"] + layer["experts"])
        moe = fetch - hidden + layer["experts"]
    elif gpu:
        # each miss is copied up as soon as its read lands (GpuExperts.compute), so the link works beside
        # the drives: the layer's fetch is the slower of the two, plus the copy of the last read to land
        one_copy = S / copy_rate / devices_per_layer if n_copy and copy_rate else 0.0
        # the last copy up starts once the last read has landed (drive-bound) or once the link has done
        # the rest (link-bound); a demoting policy's copies down run in the link's other direction, beside
        # them: a step is no shorter than they are
        # A read made ahead (the next layer's predicted experts, during this one) that landed before its
        # step asked hides its drive time; one in the way delays the step's reads (ReadAheadModel, below);
        # its copy up is still made in its own step (the engine copies nothing ahead), so the link's time
        # stays whole
        def moe_of(hidden: float, delay: float) -> float:
            reads = layer["disk"] - hidden + delay
            if launch is None:
                fetch = max(reads + (one_copy if n_disk else 0.0), layer["copy"])
                # the compute stream runs the slots' experts, then each miss once its copy is done (the host
                # launches a miss when its copy is issued and the misses before it in the table, those at hand
                # and then the reads in id order, are too): after the last copy only that expert's work is
                # left, if each expert computes in less time than the next copy takes (true where the link is
                # slower than the kernels read; else the layer's compute is the longer term)
                return max(layer["experts"], fetch + (one_ffn if n_copy else 0.0))
            # from the routing, where the host's first launch is stated: the device computes the experts it
            # holds and the link copies up those at hand from that launch on, while the reads (issued
            # `before` them) land; a read's copy is issued once it has landed and the step's device part
            # after its plan has begun (`copies`), the last one's once the host's part after it is made
            ends = [launch + layer["experts"]]
            if n_copy:
                ends.append(launch + layer["copy"] + one_ffn)
            if n_disk:
                ends.append(max(before + reads, copies) + (serial - before) + one_copy + one_ffn)
            return max(ends)

        moe = moe_of(0.0, 0.0)
    elif copy_rate:  # numpy reference: read, make ready, compute, in turn
        # a read made ahead overlaps the previous step, so it hides at most that step's compute (as on a GPU)
        hidden = min(prefetch * (layer["disk"] + layer["copy"]), layer["dense"] + layer["experts"])
        moe = layer["disk"] + layer["copy"] - hidden + layer["experts"]
    else:  # ggml: the experts at hand while the misses are read; then the misses set into slots, computed
        at_hand = layer["experts"] * (1 - rates.disk)

        # its reads ahead are the GPU engine's (the same ReadAhead, fed from the same prediction): the right
        # guesses landed by the step hide their reads, the wrong ones still in flight delay them (below)
        def moe_of(hidden: float, delay: float) -> float:
            return max(at_hand, layer["disk"] - hidden + delay) + layer["fill"] + layer["experts"] - at_hand

        moe = moe_of(min(prefetch * layer["disk"], layer["dense"] + layer["experts"]), 0.0)
    # a step cannot be shorter than its drives' reads of its misses (some of them made during the step
    # before). Reading ahead at accuracy p also reads wrong guesses, about (1 - p) of the misses once more
    # (a run counts its own: rates.ahead), but the engine feeds its guesses to the drives two at a time
    # and drops those still queued when their layer's routing comes (fomoepy.experts.read_ahead): they
    # take the drives' idle time in the step, never a step's own reads' time
    per_read = S / (drives.bandwidth * max(1, drives.count))
    drive_step = n_disk * per_read if n_disk and "disk" not in drop else 0.0
    if schedule == "engine" and "disk" not in drop:
        wrong = k * rates.ahead if rates.ahead else (1 - prefetch) * n_disk if prefetch else 0.0
    else:
        wrong = 0.0

    def step_of(moe: float) -> float:
        if launch is not None:  # moe runs from the routing, the host's work beside it
            step = layer["dense"] + layer["sync"] + max(host, moe)
        elif serial is not None:
            # the engine issues a step's reads as soon as it is routed (before its plan) and makes most of its copies and
            # launches while they are read: that host time overlaps the step's device work and waits; what
            # comes before the reads and after the last one lands stays in series
            step = layer["dense"] + layer["sync"] + serial + max(host - serial, moe)
        else:
            step = layer["dense"] + layer["sync"] + host + moe
        return max(step, drive_step, layer["demote"])

    right = prefetch * n_disk if schedule == "engine" and "disk" not in drop else 0.0
    if (gpu or not copy_rate) and schedule == "engine" and right + wrong > 0:
        # the guesses go to the drives once the step's own reads are issued: after the host's work before them.
        # (On the cpu backend too: a share of the misses read ahead hiding that share of the reads, as the
        # numpy engine's line above has it, projected 2.5 landed a step where a run on the bench model
        # landed 1.1, and the run's wrong guesses in the way were nowhere: +7 to +9 % over the runs.)
        ahead = ReadAheadModel(n_disk, right, wrong, per_read, drives.latency, DEPTH_PER_DRIVE * max(1, drives.count),
                               tuple(by_rank), before, max(1, drives.count))  # fmt: skip
        step = _steady(lambda t: step_of(moe_of(*ahead.at(t)[:2])))
        hidden_ahead, _, wrong_reads = ahead.at(step)
        landed = hidden_ahead / per_read
    else:
        step = step_of(moe)
        wrong_reads = min(wrong * per_read, step - drive_step)  # the drives' time on guesses that were wrong
        landed = right
    total = m.n_layer * step + head
    terms = {name: m.n_layer * t for name, t in layer.items()}
    terms["head"] = head
    compute = terms["dense"] + terms["experts"] + head
    # the drives' busy time under perfect overlap is their bytes at their bandwidth, all drives at once: a
    # read's latency overlaps other reads then (a schedule's disk term may serialise it, FOMOE's does); the
    # misses' bytes, not the wrong guesses' (a perfect predictor reads none)
    drive_bytes = m.n_layer * drive_step
    busy = {
        "device" if gpu else "host compute": compute + (0.0 if gpu else terms["copy"] + terms["plan"] + terms["fill"]),
        "drives": drive_bytes,
    }
    if gpu:
        busy["link"] = max(terms["copy"], terms["demote"])  # its two directions at once
        busy["host"] = terms["plan"]
    bound_resource = max(busy, key=busy.get)
    return Projection(
        schedule=schedule,
        backend="gpu" if gpu else "cpu",
        seconds_per_token=total,
        terms=terms,
        waits=max(0.0, total - compute - terms["sync"] - terms["plan"] - terms["fill"]),
        bound_seconds=busy[bound_resource],
        bound_resource=bound_resource,
        prefill_tokens_per_s=_prefill(work, hw, rates, (compute_rate, copy_rate, flop_rate), eff, prefill_tokens),
        efficiency=eff,
        prefill_flops_modelled=flop_rate > 0,
        host_serial=None if serial is None else m.n_layer * serial,
        wrong_reads=m.n_layer * wrong_reads,
        landed_ahead=landed,
    )


def _over_misses(work: Workload, hw: Hardware, rates: TierRates, **kw) -> Projection:
    """The engine schedule's token time averaged over how many of a step's k experts miss. A step's
    time is not linear in its misses (its terms overlap: the longest wins, and reads made ahead land in
    what the step leaves the drives), so the step at the average number of misses is shorter than the
    average step (Jensen): each of the k accesses a miss with the disk share p, independently, n misses
    come with probability C(k, n) p^n (1 - p)^(k - n), the other accesses split between the tiers as the
    rates say. The wrong guesses a step reads ahead stay the average's (they follow the predictor, not
    the step's own misses). Reported terms (busy time) are the average's: each is linear in the misses."""
    m = work.model
    k, p = m.n_expert_used, rates.disk
    mean = project(work, hw, rates, "engine", vary=False, **kw)
    prefetch = kw.get("prefetch", 0.0)
    ahead = rates.ahead if rates.ahead or not prefetch else (1 - prefetch) * rates.disk
    rest = 1.0 - p
    step = wrong = landed = 0.0
    for n in range(k + 1):
        weight = comb(k, n) * p**n * rest ** (k - n)
        if weight == 0.0:
            continue
        kept = (k - n) / (k * rest)  # the share of the other accesses left to each tier
        # (min: a tier holding all the rest, times kept at n = 0, may round a hair past 1)
        rates_n = replace(rates, device=min(1.0, rates.device * kept), host=min(1.0, rates.host * kept), disk=n / k,
                          substituted=min(1.0, rates.substituted * kept), ahead=ahead)  # fmt: skip
        q = project(work, hw, rates_n, "engine", vary=False, **kw)
        step += weight * (q.seconds_per_token - q.terms["head"])
        wrong += weight * q.wrong_reads
        landed += weight * q.landed_ahead
    total = step + mean.terms["head"]
    return replace(mean, seconds_per_token=total, waits=max(0.0, mean.waits + total - mean.seconds_per_token),
                   wrong_reads=wrong, landed_ahead=landed)  # fmt: skip


@dataclass(frozen=True)
class ReadAheadModel:
    """A step's reads made ahead in the steady state, as the engine makes them (fomoepy.experts.read_ahead).

    `start` after a layer's routing (the host's work before the step's reads are issued) the drives start
    its reads of the misses not landed ahead; then the next layer's guesses (`right` + `wrong` a step) in
    the predictor's order, most confident first, until that layer's routing, one step later. Right guesses
    that land by then hide their reads; the others are read as the step's own; wrong ones still in flight
    then are in the way: the step's reads queue behind them (at most `depth` in flight; on each of the
    `drives`, one is crossing, on average half done, and the others wait whole: a drive's reads cross one
    after another).

    `by_rank` is the predictor's measured accuracy at each position of its prediction (most confident
    first); the guesses read are spread evenly over those positions (whether a guess is resident does not
    depend on its rank: an approximation), so the share of right ones in any stretch of the reading order
    follows it: the first stretch is right more often than the last. Empty: every stretch alike, a share
    f = right / (right + wrong). With R(w) the right ones among the first w guesses read, the window holds
    w = a + R(w) reads, for a = the window's reads with none landed (t - start - latency - misses reads): each
    right one landed is a read the step no longer makes. R grows at most one per read, so the window is
    the one root of w - R(w) = a (R is linear in each stretch: solved there; with R = f w, w = a / (1 - f))."""

    misses: float  # a step's disk reads
    right: float  # of them, guessed a step ahead
    wrong: float  # guesses read that its layer does not choose
    per_read: float  # seconds of the drives' time per read
    latency: float
    depth: int  # reads ahead in flight at most
    by_rank: tuple[float, ...] = ()  # the predictor's accuracy by position, most confident first
    start: float = 0.0  # seconds from the routing to the step's reads' issue
    drives: int = 1

    def _right_among(self, w: float) -> float:
        """R(w): the right guesses among the first w read (0 <= w <= right + wrong)."""
        density, before = self._stretches
        n = len(density)
        # stretch i of the reading order (guesses / n reads long) holds density[i] of its reads right
        length = (self.right + self.wrong) / n
        whole = min(n, int(w // length)) if length > 0 else n
        got = before[whole] * length
        if whole < n:
            got += density[whole] * (w - whole * length)
        return min(self.right, got)

    def _window(self, a: float) -> float:
        """The smallest w with w - R(w) = a, for 0 < a < wrong: R is linear in each stretch, so w - R(w) is
        too; the stretch where it reaches a is solved exactly (a bisection would ask R some sixty times, and
        a projection makes this model's window some seven hundred times)."""
        density, before = self._stretches
        length = (self.right + self.wrong) / len(density)
        for i, d in enumerate(density):
            if (i + 1) * length - before[i + 1] * length >= a:  # w - R(w) at the stretch's end
                start = i * length - before[i] * length
                return min(self.right + self.wrong, i * length + (a - start) / (1.0 - d))  # d < 1 here: it rose past a
        return self.right + self.wrong

    @functools.cached_property
    def _stretches(self) -> tuple[tuple[float, ...], list[float]]:
        """The density of right guesses by stretch and its running sums (before[i]: stretches 0..i-1), made
        once: the bisections ask R(w) thousands of times per projection."""
        density = self._density()
        return density, list(itertools.accumulate(density, initial=0.0))

    def _density(self) -> tuple[float, ...]:
        """The share of right guesses in each stretch of the reading order: f times the accuracy by rank over
        its mean, mixed toward f just enough that no stretch is more than all right."""
        f = self.right / (self.right + self.wrong)
        mean = sum(self.by_rank) / len(self.by_rank) if self.by_rank else 0.0
        if mean <= 0.0:
            return (f,)
        shaped = [f * a / mean for a in self.by_rank]
        top = max(shaped)
        mix = 1.0 if top <= 1.0 else (1.0 - f) / (top - f)  # the largest mix with max(density) <= 1
        return tuple(f + mix * (d - f) for d in shaped)

    def at(self, step: float) -> tuple[float, float, float]:
        """(drive seconds hidden, seconds the step's reads wait behind wrong guesses, the drives' seconds on
        wrong guesses) for a step of `step` seconds."""
        guesses = self.right + self.wrong
        a = (step - self.start - self.latency) / self.per_read - self.misses
        if a <= 0:
            done = landed = 0.0
        elif a + self.right >= guesses:  # the window outlasts every guess: all read, every right one landed
            done, landed = guesses, self.right
        else:  # the window's reads: the root of w - R(w) = a (it grows with w: R's slope is at most 1)
            done = self._window(a)
            landed = self._right_among(done)
        in_flight = min(self.depth, guesses - done)
        if in_flight <= 0:
            return landed * self.per_read, 0.0, (done - landed) * self.per_read
        in_the_way = in_flight - (self._right_among(done + in_flight) - landed)
        # of the reads in flight, those crossing are half done on average, the ones queued behind not begun
        left = (in_flight - 0.5 * min(self.drives, in_flight)) / in_flight
        return landed * self.per_read, in_the_way * left * self.per_read, (done - landed) * self.per_read


def _steady(step_of: Callable[[float], float]) -> float:
    """The step t with t = step_of(t), for a step_of that does not grow with t (a longer step lands more reads
    ahead): bisection between step_of(large) and step_of(0)."""
    lo, hi = step_of(1e9), step_of(0.0)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if step_of(mid) > mid:
            lo = mid
        else:
            hi = mid
    return hi


def _prefill(work: Workload, hw: Hardware, rates: TierRates, rates_of_compute: tuple, eff: dict, n: int) -> float:
    """Tokens/s of an n-token prompt in one batch. Each layer reads its dense weights once and fetches
    the union of the experts its tokens pick once (uniform routing: E x (1 - (1 - k/E)^n) distinct);
    each kernel family takes the longer of its bytes and its flops (2 per multiply-add: n tokens
    through the dense matrices, n x k expert FFNs) at the family's efficiency. The head scores the
    last position only, as generation needs. Without a flops figure only bytes count: an upper bound."""
    compute_rate, copy_rate, flop_rate = rates_of_compute
    m = work.model

    def kernels(nbytes: float, flops: float, family: str) -> float:
        by_bytes = nbytes / (compute_rate * eff[family])
        return max(by_bytes, flops / (flop_rate * eff[family])) if flop_rate else by_bytes

    distinct = m.n_expert * (1 - (1 - m.n_expert_used / m.n_expert) ** n)
    fetch = distinct * (rates.host + rates.disk) * m.expert_bytes / copy_rate if copy_rate else 0.0
    if rates.disk and hw.drives.bandwidth:
        fetch += distinct * rates.disk * m.expert_bytes / (hw.drives.bandwidth * max(1, hw.drives.count))
    dense = kernels(work.dense_compute, n * m.dense_flops, "dense")
    experts = kernels(distinct * work.expert_compute, n * m.n_expert_used * m.expert_flops, "experts")
    head = kernels(work.head_compute, m.head_flops, "dense")
    return n / (m.n_layer * (dense + max(fetch, experts)) + head)


def fit_efficiency(work: Workload, hw: Hardware, rates: TierRates, tokens_per_s: float, schedule: str) -> float:
    """The one kernel efficiency (dense and experts alike) at which `project` gives tokens_per_s:
    bisection, since time per token falls monotonically as efficiency rises."""
    lo, hi = 1e-3, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        got = project(work, hw, rates, schedule, efficiency={"dense": mid, "experts": mid}).tokens_per_s
        lo, hi = (mid, hi) if got < tokens_per_s else (lo, mid)
    return (lo + hi) / 2
