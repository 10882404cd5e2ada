"""`fomoe plan`'s engine schedule, term by term: the cpu backends' steps, the GPU step's overlap of its
resident compute, copies and host time with its reads, reads made ahead, copies down and slot fills."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from test_plan import FOMOE_CAR_OFF

from fomoepy.errors import FomoeError
from fomoepy.experts.read_ahead import DEPTH_PER_DRIVE
from fomoepy.plan.hardware import hardware_from_dict, load_hardware
from fomoepy.plan.rates import TierRates
from fomoepy.plan.timemodel import GPU_EFFICIENCY, TERMS
from fomoepy.plan.timemodel import project as project_averaged


def project(*args, **kw):
    """One step's structure at the given tier shares (the tests below check it term by term); the
    average over the steps' number of misses has tests of its own, at the end."""
    return project_averaged(*args, vary=False, **kw)


def test_cpu_schedule_adds_every_term(q397):
    hw = load_hardware("cpu-only-64g").with_changes(host={"make_ready": 1e9})
    p = project(q397, hw, TierRates(0.5, 0.3, 0.2), "engine")
    assert p.seconds_per_token == pytest.approx(sum(p.terms.values()))
    assert set(p.terms) == set(TERMS)


def test_in_place_cpu_schedule_computes_the_experts_at_hand_while_the_misses_are_read(q397):
    # ggml (no make-ready): the host tier's share of the FFNs runs beside the reads, the disk share after
    hw = load_hardware("cpu-only-64g")
    for shares, read_bound in ((TierRates(0.0, 0.3, 0.7), True), (TierRates(0.0, 0.9, 0.1), False)):
        p = project(q397, hw, shares, "engine")
        n_layer = q397.model.n_layer
        layer = {name: t / n_layer for name, t in p.terms.items()}
        at_hand = layer["experts"] * shares.host
        moe = max(at_hand, layer["disk"]) + layer["experts"] * shares.disk
        assert (layer["disk"] > at_hand) == read_bound  # both sides of the max are taken
        want = n_layer * (layer["dense"] + layer["plan"] + moe) + p.terms["head"]
        assert p.seconds_per_token == pytest.approx(want, rel=1e-12)
        assert p.seconds_per_token < sum(p.terms.values())


def test_on_the_cpu_schedule_reads_made_ahead_land_in_the_drives_window_and_wrong_ones_delay_the_step(q397):
    # the cpu backend reads ahead with the GPU engine's ReadAhead: a right guess hides its read only if it
    # lands before its step asks (the drives read the step's own misses first), and a wrong guess still
    # in flight then delays the step's reads. A share of misses read ahead hiding that share of the reads
    # projected 2.5 reads landed a step where a run of the bench model at 25 % landed 1.1, and +7 to +9 %
    # over its runs
    from fomoepy.plan.timemodel import ReadAheadModel

    hw = load_hardware("cpu-only-64g")
    shares = TierRates(0.0, 0.1, 0.9)
    m = q397.model
    base = project(q397, hw, shares, "engine")
    layer = {name: t / m.n_layer for name, t in base.terms.items()}
    at_hand = layer["experts"] * shares.host
    assert layer["disk"] > at_hand  # read-bound: what lands ahead shortens the step
    per_read = m.expert_bytes / hw.drives.bandwidth
    n_disk = m.n_expert_used * shares.disk
    ahead = project(q397, hw, shares, "engine", prefetch=0.6)  # (and 0.4 of the misses read as wrong guesses)
    step = (ahead.seconds_per_token - base.terms["head"]) / m.n_layer
    model = ReadAheadModel(n_disk, 0.6 * n_disk, 0.4 * n_disk, per_read, hw.drives.latency, DEPTH_PER_DRIVE, start=layer["plan"])
    hidden, delay, _ = model.at(step)
    # some right guesses land, not all (the drives read the step's misses first), and wrong ones are in the way
    assert 0 < hidden < 0.6 * n_disk * per_read and delay > 0
    moe = max(at_hand, layer["disk"] - hidden + delay) + layer["fill"] + layer["experts"] - at_hand
    # (rel: the steady state is a 60-halving bisection of the step, ~1e-17 s; 1e-9 of a step is far above it)
    assert step == pytest.approx(layer["dense"] + layer["plan"] + moe, rel=1e-9)
    assert ahead.landed_ahead == pytest.approx(hidden / per_read, rel=1e-9)
    assert base.seconds_per_token > ahead.seconds_per_token
    # more wrong guesses read, more in the drives' way
    assert project(q397, hw, replace(shares, ahead=0.6), "engine", prefetch=0.6).seconds_per_token > ahead.seconds_per_token


def test_gpu_engine_schedule_computes_the_resident_experts_while_the_misses_arrive(q397, fomoe_rig):
    # GpuExperts launches the experts already in device slots before it waits for any copy, and each
    # copied one as its copy lands: fetch bound, only the last copied expert's FFN adds to the fetch;
    # compute bound, the copies hide under the FFNs and the layer's experts cost their compute alone
    n_layer, S = q397.model.n_layer, q397.model.expert_bytes
    rig = fomoe_rig.with_changes(host={"serial": None})  # all host time in series: the MoE half alone below
    for shares, fetch_bound in ((FOMOE_CAR_OFF[0], True), (TierRates(0.95, 0.05, 0.0), False)):
        p = project(q397, rig, shares, "engine")
        layer = {name: t / n_layer for name, t in p.terms.items()}
        fetch = max(layer["disk"], layer["copy"]) + (S / fomoe_rig.device.link if shares.disk else 0.0)
        resident = layer["experts"] * shares.device
        assert (fetch > resident) == fetch_bound  # both sides of the overlap are taken
        moe = fetch + layer["experts"] / q397.model.n_expert_used if fetch_bound else layer["experts"]
        want = n_layer * (layer["dense"] + layer["sync"] + layer["plan"] + moe) + p.terms["head"]
        assert p.seconds_per_token == pytest.approx(want, rel=1e-12)


def test_the_gpu_engines_host_time_beside_its_reads_overlaps_them(q397, fomoe_rig):
    # host time per layer = serial (before the reads are issued, after the last lands) + the rest (copies
    # and launches made while the reads are in flight): a step takes serial + max(rest, the MoE half's work)
    host = 300e-6
    # (the experts a step holds computing from the end of serial: the first launch's time unstated)
    rig = fomoe_rig.with_changes(host={"plan": host, "serial": None, "before_launch": None})
    for shares in (FOMOE_CAR_OFF[0], TierRates(0.95, 0.05, 0.0)):  # fetch bound, then compute bound
        base = project(q397, rig, shares, "engine")
        n_layer = q397.model.n_layer
        bare = project(q397, rig.with_changes(host={"plan": 0.0}), shares, "engine")
        moe = (bare.seconds_per_token - bare.terms["head"]) / n_layer - (bare.terms["dense"] + bare.terms["sync"]) / n_layer
        for in_series in (0.0, 100e-6, host):
            split = project(q397, rig.with_changes(host={"serial": in_series}), shares, "engine")
            want = base.seconds_per_token - n_layer * (host - in_series - max(0.0, host - in_series - moe))
            assert split.seconds_per_token == pytest.approx(want, rel=1e-12)
            assert split.host_serial == pytest.approx(n_layer * in_series, rel=1e-12)
        assert moe > host  # the fetch-bound and compute-bound steps both hide this host time's remainder
    # FOMOE's schedule keeps its own host time, serial
    fomoe = project(q397, rig.with_changes(host={"serial": 0.0}), FOMOE_CAR_OFF[0], "fomoe")
    assert fomoe.seconds_per_token == project(q397, rig, FOMOE_CAR_OFF[0], "fomoe").seconds_per_token
    assert fomoe.host_serial is None


def test_host_time_beside_the_reads_longer_than_the_step_adds_only_its_excess(q397, fomoe_rig):
    shares = TierRates(1.0, 0.0, 0.0)  # all resident: the MoE half is the experts' compute alone
    n_layer = q397.model.n_layer
    bare = project(q397, fomoe_rig.with_changes(host={"plan": 0.0}), shares, "engine")
    moe = (bare.seconds_per_token - bare.terms["head"] - bare.terms["dense"] - bare.terms["sync"]) / n_layer
    host = 3 * moe
    split = project(q397, fomoe_rig.with_changes(host={"plan": host, "serial": moe, "before_launch": None}), shares, "engine")
    # serial (moe) + max(2 moe, moe): three moe of host time a step, the device's work under it
    assert split.seconds_per_token == pytest.approx(bare.seconds_per_token + n_layer * (host - moe), rel=1e-12)


def test_the_device_computes_the_experts_it_holds_from_the_steps_first_launch(q397, fomoe_rig):
    # [host] before_launch: the cache plan and the device tier's evictions come before a step's first
    # launch, so the experts the device holds compute from then on, not from the reads' issue: a step of
    # resident experts takes dense + sync + max(host, before_launch + experts). Unstated, they start at
    # the end of serial (the reads' issue plus the host's part after the last lands), as before.
    host, serial = 300e-6, 100e-6
    rig = fomoe_rig.with_changes(host={"plan": host, "serial": serial, "before_reads": 50e-6})
    n = q397.model.n_layer
    # all in slots; some copied up from the host tier; half of them (the link's chain the longer)
    for shares in (TierRates(1.0, 0.0, 0.0), TierRates(0.9, 0.1, 0.0), TierRates(0.5, 0.5, 0.0)):
        unstated = project(q397, rig.with_changes(host={"before_launch": None}), shares, "engine")
        assert project(q397, rig.with_changes(host={"before_launch": serial}), shares, "engine").seconds_per_token == \
            pytest.approx(unstated.seconds_per_token, rel=1e-12)
        t = {name: v / n for name, v in unstated.terms.items()}
        copied = t["copy"] + t["experts"] / q397.model.n_expert_used if t["copy"] else 0.0  # the link's chain
        for launch in (150e-6, 250e-6, host):
            p = project(q397, rig.with_changes(host={"before_launch": launch}), shares, "engine")
            want = n * (t["dense"] + t["sync"] + max(host, launch + max(t["experts"], copied))) + unstated.terms["head"]
            assert p.seconds_per_token == pytest.approx(want, rel=1e-12)
            assert p.seconds_per_token > unstated.seconds_per_token
            # [host] before_copies: a read's copy up starts after the step's plan; those at hand (all here)
            # go up from the first launch
            p = project(q397, rig.with_changes(host={"before_launch": launch, "before_copies": host}), shares, "engine")
            assert p.seconds_per_token == pytest.approx(want, rel=1e-12)
    # a read copied up once it has landed and the step's plan is made ([host] before_copies): on a drive
    # that lands it at once, the plan's end is what the read's copy waits for
    fast = fomoe_rig.with_changes(host={"plan": 600e-6, "serial": 100e-6, "before_reads": 50e-6, "before_launch": 100e-6},
                                  drives={"bandwidth": 1e15, "latency": 1e-9})  # fmt: skip
    shares = TierRates(0.9, 0.0, 0.1)  # one miss a step
    for copies in (100e-6, 600e-6):
        p = project(q397, fast.with_changes(host={"before_copies": copies}), shares, "engine")  # (the step at the average misses)
        t = {name: v / n for name, v in p.terms.items()}
        one_copy, one_ffn = t["copy"], t["experts"] / q397.model.n_expert_used
        chains = (600e-6, 100e-6 + t["experts"], 100e-6 + t["copy"] + one_ffn,
                  max(50e-6 + t["disk"], copies) + (100e-6 - 50e-6) + one_copy + one_ffn)
        assert p.seconds_per_token == pytest.approx(n * (t["dense"] + t["sync"] + max(chains)) + p.terms["head"], rel=1e-12)
        assert (max(chains) == chains[3]) == (copies == 600e-6)  # the read's chain binds only when it waits for the plan
    data = {"host": {"memory": "8G", "bandwidth": "1 GB/s", "matvec": "1 GB/s", "plan": "100 us", "before_launch": "120 us"},
            "drives": {"count": 1, "bandwidth": "1 GB/s", "latency": "1 us"}}  # fmt: skip
    with pytest.raises(FomoeError, match=r"before_launch is a part of plan, so at most 100 us; got 120 us"):
        hardware_from_dict(data, "rig.toml")
    data["host"] = data["host"] | {"before_launch": "50 us", "before_copies": "130 us"}
    with pytest.raises(FomoeError, match=r"before_copies is a part of plan, so at most 100 us; got 130 us"):
        hardware_from_dict(data, "rig.toml")


def predictor_seconds(work, rig) -> float:
    """Per token, the device's time on the next layer's router, which a decode step reading ahead runs
    for its prediction (MoEStep.predicts): its bytes at the dense kernels' rate, every layer."""
    return work.model.n_layer * work.model.router_bytes / (rig.device.bandwidth * GPU_EFFICIENCY)


def test_a_read_made_ahead_hides_drive_time_not_the_links(q397, fomoe_rig):
    # the engine reads the next layer's predicted experts during this one but copies them up in their own
    # step: where the link is the slower side, reading ahead gains nothing, and costs the prediction
    rig = fomoe_rig.with_changes(host={"serial": None})
    link_bound = TierRates(0.3, 0.6, 0.1)
    layer = {n: t / q397.model.n_layer for n, t in project(q397, rig, link_bound, "engine").terms.items()}
    assert layer["copy"] > layer["disk"]
    assert q397.model.router_bytes > 0
    assert project(q397, rig, link_bound, "engine", prefetch=0.8).seconds_per_token == pytest.approx(
        project(q397, rig, link_bound, "engine").seconds_per_token + predictor_seconds(q397, rig), rel=1e-12)
    # where the drive is, it hides up to the step before's compute
    disk_bound = FOMOE_CAR_OFF[0]
    assert project(q397, rig, disk_bound, "engine", prefetch=0.6).seconds_per_token < project(q397, rig, disk_bound, "engine").seconds_per_token


def test_wrong_guesses_take_the_drives_idle_time_and_only_those_in_flight_delay_a_step(q397, fomoe_rig):
    # a run's wrong guesses (rates.ahead) are read in the drives' time after the step's own reads; where
    # that window holds them all, the step is as long as without them and the drives spent k x ahead reads
    # on them; where the drives have no time left (a 1 GB/s drive), the reads of the next layer queue
    # behind the guesses in flight, the rest of each
    m = q397.model
    k, S = m.n_expert_used, m.expert_bytes
    light, plain = TierRates(0.6, 0.12, 0.28, ahead=0.01), TierRates(0.6, 0.12, 0.28)
    base = project(q397, fomoe_rig, plain, "engine")
    p = project(q397, fomoe_rig, light, "engine")
    # (reading ahead, a step predicts: the next layer's router is read on the device)
    # (rel: both sides sum the same ~60 layers' terms in another order, a few roundings of 2^-53 each; 1e-9 is
    # far above that and far below the predictor's share of a token, 2.6e-2)
    assert p.seconds_per_token == pytest.approx(base.seconds_per_token + predictor_seconds(q397, fomoe_rig), rel=1e-9)
    assert p.wrong_reads == pytest.approx(m.n_layer * k * 0.01 * S / fomoe_rig.drives.bandwidth, rel=1e-12)
    slow = fomoe_rig.with_changes(drives={"bandwidth": 1e9})
    base, p = project(q397, slow, plain, "engine"), project(q397, slow, TierRates(0.6, 0.12, 0.28, ahead=0.3), "engine")
    base = replace(base, seconds_per_token=base.seconds_per_token + predictor_seconds(q397, slow))
    # the drives get to a guess only in what the last read's copy and FFN leave them: nearly every step
    # routes with the depth's guesses in flight, the one crossing half read, those queued behind it unread
    most = m.n_layer * (DEPTH_PER_DRIVE - 0.5) * S / 1e9
    assert base.seconds_per_token + 0.5 * most < p.seconds_per_token <= base.seconds_per_token + most
    assert p.wrong_reads < 0.5 * m.n_layer * k * 0.3 * S / 1e9 and p.bound_resource == "drives"
    assert p.bound_seconds == pytest.approx(m.n_layer * k * 0.28 * S / 1e9, rel=1e-12)  # the misses' bytes alone
    # FOMOE's schedule reads nothing ahead
    assert project(q397, fomoe_rig, light, "fomoe").seconds_per_token == project(q397, fomoe_rig, plain, "fomoe").seconds_per_token
    with pytest.raises(FomoeError, match="read ahead"):
        TierRates(0.6, 0.12, 0.28, ahead=1.5)


def test_a_serial_part_larger_than_the_host_time_is_one_clear_error():
    data = {"host": {"memory": "8G", "bandwidth": "1 GB/s", "matvec": "1 GB/s", "plan": "100 us", "serial": "150 us"},
            "drives": {"count": 1, "bandwidth": "1 GB/s", "latency": "1 us"}}  # fmt: skip
    with pytest.raises(FomoeError, match=r"serial is a part of plan, so at most 100 us; got 150 us"):
        hardware_from_dict(data, "rig.toml")


def test_a_demoting_policys_copies_down_run_beside_the_copies_up(q397, fomoe_rig):
    # each device evictee a demoting policy moves to the host tier crosses the link, k x demoted x S / link
    # a layer, on a stream of its own, in the link's other direction (GpuExperts._download): it leaves the
    # layer's fetch as it was and only bounds the step from below. On the fomoe-rig it never binds; over a
    # link ten times slower, copying down more experts than are copied up, it does
    plain = TierRates(0.6, 0.12, 0.28)
    m = q397.model
    for rig, binds in ((fomoe_rig, False), (fomoe_rig.with_changes(device={"link": fomoe_rig.device.link / 10}), True)):
        base = project(q397, rig, plain, "engine")
        base_layer = (base.seconds_per_token - base.terms["head"]) / m.n_layer
        for share in (0.3, 0.8):
            demoting = TierRates(0.6, 0.12, 0.28, demoted=share)
            per_token = m.n_layer * m.n_expert_used * share * m.expert_bytes / rig.device.link
            p = project(q397, rig, demoting, "engine")
            assert p.terms["demote"] == pytest.approx(per_token, rel=1e-12)
            demote = p.terms["demote"] / m.n_layer
            want = m.n_layer * max(base_layer, demote) + base.terms["head"]
            assert p.seconds_per_token == pytest.approx(want, rel=1e-12)
            assert (demote > base_layer) == (binds and share == 0.8)
    # FOMOE's schedule has its own tiers, a CPU backend no device tier: nothing to copy down
    assert project(q397, fomoe_rig, demoting, "fomoe").seconds_per_token == project(q397, fomoe_rig, plain, "fomoe").seconds_per_token
    cpu = load_hardware("cpu-only-64g")
    assert project(q397, cpu, demoting, "engine").terms["demote"] == 0.0
    with pytest.raises(FomoeError, match="demoted share"):
        TierRates(0.6, 0.12, 0.28, demoted=1.5)


def test_the_cpu_backend_sets_each_miss_into_a_tier_slot_once_the_reads_have_landed(q397):
    # ggml computes the experts at hand while the misses are read, then sets each miss into a slot of
    # its tier (in the tier's form: GgmlExperts._install_admitted / stage), then computes them: k x disk share x S /
    # host.fill more per layer, in series; a file without `fill` has none (store bytes computed in place)
    cpu = load_hardware("cpu-only-64g")
    shares = TierRates(0.0, 0.6, 0.4)
    m = q397.model
    plain = project(q397, cpu.with_changes(host={"fill": 0.0}), shares, "engine")
    filled = project(q397, cpu.with_changes(host={"fill": 2e9}), shares, "engine")
    per_token = m.n_layer * m.n_expert_used * shares.disk * m.expert_bytes / 2e9
    assert plain.terms["fill"] == 0.0 and filled.terms["fill"] == pytest.approx(per_token, rel=1e-12)
    assert filled.seconds_per_token - plain.seconds_per_token == pytest.approx(per_token, rel=1e-9)
    assert filled.waits == pytest.approx(plain.waits, rel=1e-9, abs=1e-12)  # a fill is work, not a wait
    # only the misses the tier keeps are set into slots (host.fill_share of them): a decode step computes
    # the others where their reads landed
    third = project(q397, cpu.with_changes(host={"fill": 2e9, "fill_share": 1 / 3}), shares, "engine")
    assert third.terms["fill"] == pytest.approx(per_token / 3, rel=1e-12)
    assert third.seconds_per_token - plain.seconds_per_token == pytest.approx(per_token / 3, rel=1e-9)
    from fomoepy.plan.report import describe

    lines = [describe(q397, cpu, "stated", shares, p) for p in (filled, plain)]
    assert "slot fills" in lines[0] and "slot fills" not in lines[1]
    gpu = load_hardware("fomoe-rig").with_changes(host={"fill": 2e9})  # a GPU backend copies up instead
    assert project(q397, gpu, shares, "engine").terms["fill"] == 0.0


def test_the_read_ahead_steady_state_lands_what_the_drives_window_holds():
    # a step's drives read its own misses (those not landed ahead), then the next layer's guesses, right
    # and wrong interleaved, until that layer routes one step later
    from fomoepy.plan.timemodel import ReadAheadModel

    r, lat = 1e-3, 1e-4
    m = ReadAheadModel(misses=3.0, right=2.0, wrong=2.0, per_read=r, latency=lat, depth=2)
    # a long step: every guess lands, none is in the way, every wrong one took the drives' time
    hidden, delay, wrong = m.at(lat + 10 * r)
    assert (hidden, delay, wrong) == (2 * r, 0.0, pytest.approx(2 * r, rel=1e-12))
    # no window at all: nothing lands; the depth's guesses are in flight, half of them wrong: on the one
    # drive the first crosses (half read on average), the second waits behind it
    hidden, delay, wrong = m.at(lat + 3 * r)
    assert hidden == 0.0 and delay == pytest.approx(0.5 * (0.5 + 1.0) * r, rel=1e-12) and wrong == 0.0
    # on two drives both cross at once
    two = ReadAheadModel(misses=3.0, right=2.0, wrong=2.0, per_read=r, latency=lat, depth=2, drives=2)
    assert two.at(lat + 3 * r)[1] == pytest.approx(0.5 * (0.5 + 0.5) * r, rel=1e-12)
    # the guesses go to the drives only once the step's own reads are issued: the host's work before them
    # takes its time off their window
    late = ReadAheadModel(misses=3.0, right=2.0, wrong=2.0, per_read=r, latency=lat, depth=2, start=r)
    assert late.at(lat + 4.5 * r) == pytest.approx(m.at(lat + 3.5 * r), rel=1e-12)
    # in between: the guesses read in the window are the step less its own reads, half of them right
    t = lat + 4.5 * r
    hidden, delay, wrong = m.at(t)
    landed = hidden / r
    done = (t - lat) / r - (3.0 - landed)
    assert landed == pytest.approx(0.5 * done, rel=1e-12) and wrong == pytest.approx(0.5 * done * r, rel=1e-12)
    assert 0 < landed < 2.0 and delay > 0
    # with no wrong guesses, the right ones land once the step leaves the drives any time
    assert ReadAheadModel(3.0, 2.0, 0.0, r, lat, 2).at(lat + 3.1 * r)[:2] == (2 * r, 0.0)


def test_guesses_read_most_confident_first_land_the_likelier_ones_first():
    # the engine reads a prediction's first choices first; where those are right more often than the last,
    # a window that holds only part of the guesses lands more right ones than the average share would
    from fomoepy.plan.timemodel import ReadAheadModel

    r, lat = 1e-3, 0.0
    flat = ReadAheadModel(misses=4.0, right=2.0, wrong=2.0, per_read=r, latency=lat, depth=2)
    ranked = ReadAheadModel(misses=4.0, right=2.0, wrong=2.0, per_read=r, latency=lat, depth=2, by_rank=(0.9, 0.7, 0.3, 0.1))
    # a window of one read with none landed (a = 5 - 4): each stretch of the reading order is one read, right
    # 0.9, 0.7, 0.3, 0.1 of the time; the window w = 1 + R(w) falls in the third: w = 1 + 1.6 + 0.3 (w - 2),
    # w = 2 / 0.7; where every stretch is right half the time, w = 1 / (1 - 0.5) = 2 and one lands
    hidden, delay, wrong = ranked.at(lat + 5 * r)
    w = 2 / 0.7
    assert hidden == pytest.approx((1.6 + 0.3 * (w - 2)) * r, rel=1e-9) and wrong == pytest.approx((w - hidden / r) * r, rel=1e-9)
    assert flat.at(lat + 5 * r)[0] == pytest.approx(1.0 * r, rel=1e-12)
    # in flight at the routing: the rest of the guesses (4 - w), of them the right ones left (2 - R(w)); the
    # first crosses (half read), the rest waits whole
    in_flight, right_left = 4 - w, 2 - hidden / r
    assert delay == pytest.approx((in_flight - right_left) * (in_flight - 0.5) / in_flight * r, rel=1e-9)
    # a window that holds every guess lands every right one, whatever the order
    assert ranked.at(lat + 9 * r)[0] == flat.at(lat + 9 * r)[0] == 2 * r
    # an accuracy by rank higher than the guesses read can hold right is flattened, never above all right
    steep = ReadAheadModel(misses=4.0, right=3.0, wrong=1.0, per_read=r, latency=lat, depth=2, by_rank=(1.0, 0.2))
    assert max(steep._density()) == pytest.approx(1.0) and sum(steep._density()) / 2 == pytest.approx(0.75)


def test_a_more_accurate_predictor_never_makes_a_projection_slower(q397, fomoe_rig):
    # more of the misses guessed right, fewer wrong: more land ahead and fewer are in the way, so the
    # step the projection settles on is never longer
    m, shares = q397.model, FOMOE_CAR_OFF[0]
    steps = [project(q397, fomoe_rig, shares, "engine", prefetch=p) for p in (0.0, 0.3, 0.6, 0.9)]
    per_layer = [(s.seconds_per_token - s.terms["head"]) / m.n_layer for s in steps]
    assert all(a >= b for a, b in itertools.pairwise(per_layer)) and per_layer[0] > per_layer[-1]
    assert steps[0].landed_ahead == 0.0 and all(0 < s.landed_ahead for s in steps[1:])


def test_one_tier_holding_every_access_the_disk_does_not_projects_at_every_number_of_misses(q397):
    # 1 - 0.535 is a hair under 0.465 in floats: the step with no miss gave that tier a share a hair past 1,
    # which was refused (`fomoe plan --hit-rates 0,46.5,53.5` failed on a cpu rig)
    assert 0.465 / (1 - 0.535) > 1.0
    hw = load_hardware("cpu-only-64g")
    varied = project_averaged(q397, hw, TierRates(0.0, 0.465, 0.535), "engine")
    at_mean = project_averaged(q397, hw, TierRates(0.0, 0.465, 0.535), "engine", vary=False)
    assert varied.seconds_per_token >= at_mean.seconds_per_token > 0


def test_the_engine_schedule_is_averaged_over_the_steps_misses(q397, fomoe_rig):
    # each of a step's k accesses a miss with the disk share, independently: where a step's time is linear
    # in its misses (the numpy reference's schedule adds every term) the average is the step at the
    # average number of misses (the weights sum to 1, their mean is k x the share), but for the drive's
    # latency, which a step with no miss (probability (1 - share)^k) does not wait; where terms overlap
    # (the GPU step: the longest wins, reads ahead land in what the drives are left), the average step is
    # longer (Jensen), never shorter; FOMOE's schedule, and shares with nothing to vary, are as they were
    reference = load_hardware("cpu-only-64g").with_changes(host={"make_ready": 5e9})
    shares = TierRates(0.5, 0.3, 0.2)
    linear = [project_averaged(q397, reference, shares, "engine", vary=v) for v in (True, False)]
    no_miss = (1 - 0.2) ** q397.model.n_expert_used
    saved = q397.model.n_layer * reference.drives.latency * no_miss
    assert linear[0].seconds_per_token == pytest.approx(linear[1].seconds_per_token - saved, rel=1e-12)
    for rates, prefetch in ((FOMOE_CAR_OFF[0], 0.0), (FOMOE_CAR_OFF[0], 0.61), (TierRates(0.3, 0.3, 0.4), 0.8)):
        varied, at_mean = (project_averaged(q397, fomoe_rig, rates, "engine", prefetch=prefetch, vary=v) for v in (True, False))
        assert varied.seconds_per_token >= at_mean.seconds_per_token
        assert varied.terms == at_mean.terms  # busy time: linear in the misses
    assert varied.seconds_per_token > at_mean.seconds_per_token
    for rates, schedule in ((FOMOE_CAR_OFF[0], "fomoe"), (TierRates(0.7, 0.3, 0.0), "engine")):
        assert project_averaged(q397, fomoe_rig, rates, schedule).seconds_per_token == \
            project_averaged(q397, fomoe_rig, rates, schedule, vary=False).seconds_per_token


def test_the_guesses_window_opens_once_the_steps_own_reads_are_issued(q397, fomoe_rig):
    # the engine issues the next layer's guesses after its step's reads, which come after the host's work
    # before them ([host] before_reads, of serial): the less of it, the more of the guesses land
    shares = TierRates(0.6, 0.12, 0.28)
    serial = fomoe_rig.host.serial
    landed = [project(q397, fomoe_rig.with_changes(host={"before_reads": b}), shares, "engine", prefetch=0.6).landed_ahead
              for b in (serial, serial / 2, 0.0)]  # fmt: skip
    assert landed[0] < landed[1] < landed[2]
    # unstated, all of serial comes before the reads (the shorter window)
    unstated = fomoe_rig.with_changes(host={"before_reads": None})
    assert project(q397, unstated, shares, "engine", prefetch=0.6).landed_ahead == landed[0]
    data = {"host": {"memory": "8G", "bandwidth": "1 GB/s", "matvec": "1 GB/s", "plan": "100 us", "serial": "50 us", "before_reads": "60 us"},
            "drives": {"count": 1, "bandwidth": "1 GB/s", "latency": "1 us"}}  # fmt: skip
    with pytest.raises(FomoeError, match=r"before_reads is a part of serial, so at most 50 us; got 60 us"):
        hardware_from_dict(data, "rig.toml")
