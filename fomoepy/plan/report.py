"""What `fomoe plan` prints: one projection with its terms, and the assumptions it rests on."""

from __future__ import annotations

from fomoepy.experts.sizes import format_size
from fomoepy.plan.hardware import Hardware
from fomoepy.plan.rates import TierRates
from fomoepy.plan.timemodel import GPU_EFFICIENCY, Projection, Workload


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f} ms"


def rates_line(r: TierRates) -> str:
    sub = f"  substituted {100 * r.substituted:5.1f}%" if r.substituted else ""
    return f"device {100 * r.device:5.1f}%  host {100 * r.host:5.1f}%  disk {100 * r.disk:5.1f}%{sub}"


def describe(work: Workload, hw: Hardware, hw_source: str, rates: TierRates, p: Projection, capacity=None) -> str:
    m, t = work.model, p.terms
    lines = [
        f"model: {m.name} at {m.mix}: {m.n_layer} layers x {m.n_expert} experts (top-{m.n_expert_used}), "
        f"expert {m.expert_bytes / 2**20:.2f} MiB, store {m.store_bytes / 2**30:.1f} GiB, "
        f"resident {format_size(m.resident_bytes)}",
        f"hardware: {hw.name} ({hw_source})",
    ]
    if capacity is not None:
        lines.append(
            f"expert cache: device {format_size(capacity.device)}, host {format_size(capacity.host)} "
            f"({100 * capacity.device / m.store_bytes:.1f}% + {100 * capacity.host / m.store_bytes:.1f}% of the store)"
            + ("; unused: the hit rates are given" if rates.source.startswith("given") else "")
        )
    lines += [
        f"routing ({rates.source}): {rates_line(rates)}",
        f"schedule: {p.schedule}, {p.backend} backend",
        f"decode: {p.tokens_per_s:.2f} tok/s ({p.seconds_per_token * 1e3:.1f} ms/token); "
        f"prefill {'' if p.prefill_flops_modelled else '<= '}{p.prefill_tokens_per_s:.1f} tok/s (512-token prompt, "
        + ("bytes and flops)" if p.prefill_flops_modelled else "bytes bound: the hardware file states no flops)"),
        "time per token by term (busy time, before overlap):",
        f"  {'device compute' if p.backend == 'gpu' else 'compute':<15}{_ms(t['dense'] + t['experts'] + t['head'])}"
        f"  (dense {t['dense'] * 1e3:.1f}, experts {t['experts'] * 1e3:.1f}, head {t['head'] * 1e3:.1f})",
        f"  {'host -> device' if p.backend == 'gpu' else 'make ready':<15}{_ms(t['copy'])}",
        *([(f"  {'device -> host':<15}{_ms(t['demote'])}  (a demoting policy's evictees, {100 * rates.demoted:.1f}% of "
             "accesses, each copied down once the step's reads are issued, beside the copies up)")] if t.get("demote") else []),
        *([(f"  {'slot fills':<15}{_ms(t['fill'])}  (the misses the tier keeps, {100 * hw.host.fill_share:.0f}% of them, each set "
             "into a tier slot in its form once the reads have landed; the others are computed where they landed)")] if t.get("fill") else []),
        f"  {'disk reads':<15}{_ms(t['disk'])}",
        f"  {'host':<15}{_ms(t['sync'] + t['plan'])}  (router read-back {t['sync'] * 1e3:.1f}, plan {t['plan'] * 1e3:.1f}"
        + (f"; {p.host_serial * 1e3:.1f} of it in series with the reads, the rest beside them)"
           if p.host_serial is not None else ")"),
        f"  {'waits':<15}{_ms(p.waits)}  (compute idle, waiting for expert bytes)",
        f"bound under perfect overlap: {1 / p.bound_seconds:.2f} tok/s ({p.bound_resource} busy {p.bound_seconds * 1e3:.1f} ms)",
        "rests on: " + assumptions(p),
    ]
    return "\n".join(lines)


def assumptions(p: Projection) -> str:
    eff = ", ".join(f"{k} {v:.3g}" for k, v in p.efficiency.items())
    why = (
        f"kernel efficiency ({eff}) of device bandwidth; the default {GPU_EFFICIENCY} is fitted to FOMOE's "
        "published 8.8 tok/s (CAR 0.35) on RDNA4, not measured on our kernels, which reached 0.18 (Q4_K "
        "experts) and 0.21 (Q4_K dense) of an H100's copy bandwidth (bench/gpu_kernels.py; --efficiency)"
        if p.backend == "gpu"
        else f"compute at the host matvec rate x ({eff})"
    )
    return f"the hardware figures as stated; exact bytes per expert and per layer; {why}; batching not counted, reads ahead as the next line says"


def sweep_table(rows: list[tuple[str, TierRates, Projection]]) -> str:
    out = [f"{'setting':<28} {'device':>7} {'host':>6} {'disk':>6} {'subst':>6} {'tok/s':>7} {'bound':>7}"]
    for label, r, p in rows:
        out.append(
            f"{label:<28} {100 * r.device:6.1f}% {100 * r.host:5.1f}% {100 * r.disk:5.1f}% {100 * r.substituted:5.1f}% "
            f"{p.tokens_per_s:7.2f} {1 / p.bound_seconds:7.2f}"
        )
    return "\n".join(out)


def steps_table(rows: list[tuple[str, Projection]]) -> str:
    out = [f"{'step':<48} {'tok/s':>7} {'change':>8} {'ms/token':>9} {'waits':>7} {'bound':>7}"]
    before = None
    for label, p in rows:
        change = "" if before is None or label.startswith("our") else f"{100 * (p.tokens_per_s / before - 1):+7.1f}%"
        out.append(
            f"{label:<48} {p.tokens_per_s:7.2f} {change:>8} {p.seconds_per_token * 1e3:9.1f} {p.waits * 1e3:7.1f} "
            f"{1 / p.bound_seconds:7.2f}"
        )
        before = p.tokens_per_s
    bound = rows[0][1]
    out.append(f"(bound: perfect overlap; FOMOE's schedule is bound by {bound.bound_resource} at {1 / bound.bound_seconds:.2f} tok/s)")
    return "\n".join(out)
