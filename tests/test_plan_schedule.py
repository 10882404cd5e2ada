"""`fomoe plan`'s engine schedule, term by term: the cpu backends' steps, the GPU step's overlap of its
resident compute, copies and host time with its reads, reads made ahead, copies down and slot fills."""

from __future__ import annotations

import pytest
from test_plan import FOMOE_CAR_OFF

from fomoepy.errors import FomoeError
from fomoepy.plan.hardware import hardware_from_dict, load_hardware
from fomoepy.plan.rates import TierRates
from fomoepy.plan.timemodel import TERMS, project


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


def test_on_the_cpu_schedule_a_read_made_ahead_hides_at_most_the_step_before_it(q397):
    # a prefetched read overlaps the previous step's compute: on a read-bound CPU run it saves that much, not
    # the read (a drive busy reading ahead is not free). The cpu backend's generate run at 25 % of the bench
    # model read 57 % of its experts: projected from its hits and the measured 61 % accuracy without the
    # cap, +57 % over what it measured; with it, within 2 %.
    hw = load_hardware("cpu-only-64g")
    shares = TierRates(0.0, 0.1, 0.9)
    n_layer = q397.model.n_layer
    base = project(q397, hw, shares, "engine")
    layer = {name: t / n_layer for name, t in base.terms.items()}
    # read-bound by more than a step's compute and the experts at hand: the cap binds
    assert layer["disk"] - (layer["dense"] + layer["experts"]) > layer["experts"] * shares.host
    ahead = project(q397, hw, shares, "engine", prefetch=1.0)
    saved = base.seconds_per_token - ahead.seconds_per_token
    at_hand, hidden = layer["experts"] * shares.host, layer["dense"] + layer["experts"]
    want = n_layer * (max(at_hand, layer["disk"]) - max(at_hand, layer["disk"] - hidden))
    assert saved == pytest.approx(want, rel=1e-9) and 0 < saved < n_layer * layer["disk"]


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
    rig = fomoe_rig.with_changes(host={"plan": host, "serial": None})
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
    split = project(q397, fomoe_rig.with_changes(host={"plan": host, "serial": moe}), shares, "engine")
    # serial (moe) + max(2 moe, moe): three moe of host time a step, the device's work under it
    assert split.seconds_per_token == pytest.approx(bare.seconds_per_token + n_layer * (host - moe), rel=1e-12)


def test_a_read_made_ahead_hides_drive_time_not_the_links(q397, fomoe_rig):
    # the engine reads the next layer's predicted experts during this one but copies them up in their own
    # step: where the link is the slower side, reading ahead gains nothing
    rig = fomoe_rig.with_changes(host={"serial": None})
    link_bound = TierRates(0.3, 0.6, 0.1)
    layer = {n: t / q397.model.n_layer for n, t in project(q397, rig, link_bound, "engine").terms.items()}
    assert layer["copy"] > layer["disk"]
    assert project(q397, rig, link_bound, "engine", prefetch=0.8).seconds_per_token == pytest.approx(
        project(q397, rig, link_bound, "engine").seconds_per_token, rel=1e-12)
    # where the drive is, it hides up to the step before's compute
    disk_bound = FOMOE_CAR_OFF[0]
    assert project(q397, rig, disk_bound, "engine", prefetch=0.6).seconds_per_token < project(q397, rig, disk_bound, "engine").seconds_per_token


def test_reading_ahead_also_reads_the_wrong_guesses_and_no_step_outruns_the_drives(q397, fomoe_rig):
    # at accuracy p, about (1 - p) of the misses are read once more for nothing: a drive of 1 GB/s then
    # sets the pace, (1 + (1 - p)) x the misses' bytes a layer
    rig = fomoe_rig.with_changes(drives={"bandwidth": 1e9}, host={"serial": None})
    m, shares = q397.model, FOMOE_CAR_OFF[0]
    drive_step = (1 + 0.4) * m.n_expert_used * shares.disk * m.expert_bytes / 1e9
    p = project(q397, rig, shares, "engine", prefetch=0.6)
    assert p.seconds_per_token == pytest.approx(m.n_layer * drive_step + p.terms["head"], rel=1e-12)
    assert p.bound_seconds == pytest.approx(m.n_layer * drive_step, rel=1e-12) and p.bound_resource == "drives"


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
    # its tier, repacked (GgmlExperts._install_admitted / stage), then computes them: k x disk share x S /
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
    from fomoepy.plan.report import describe

    lines = [describe(q397, cpu, "stated", shares, p) for p in (filled, plain)]
    assert "slot fills" in lines[0] and "slot fills" not in lines[1]
    gpu = load_hardware("fomoe-rig").with_changes(host={"fill": 2e9})  # a GPU backend copies up instead
    assert project(q397, gpu, shares, "engine").terms["fill"] == 0.0


def test_a_runs_reads_made_ahead_take_the_drives_time(q397, fomoe_rig):
    # a run's counts hold its read-ahead hits as host hits; the reads made ahead (right or wrong) still
    # took the drives' time, beside the step before theirs: a step is no shorter than all its drive's reads
    m = q397.model
    plain = TierRates(0.6, 0.12, 0.28)
    base = project(q397, fomoe_rig, plain, "engine")
    base_layer = (base.seconds_per_token - base.terms["head"]) / m.n_layer
    one_read = m.expert_bytes / (fomoe_rig.drives.bandwidth * fomoe_rig.drives.count)
    for ahead, binds in ((0.05, False), (0.3, True)):
        p = project(q397, fomoe_rig, TierRates(0.6, 0.12, 0.28, ahead=ahead), "engine")
        drive = (m.n_expert_used * (0.28 + ahead)) * one_read
        assert p.seconds_per_token == pytest.approx(m.n_layer * max(base_layer, drive) + base.terms["head"], rel=1e-12)
        assert (drive > base_layer) == binds
        assert project(q397, fomoe_rig, TierRates(0.6, 0.12, 0.28, ahead=ahead), "fomoe").seconds_per_token == \
            project(q397, fomoe_rig, plain, "fomoe").seconds_per_token  # FOMOE's schedule reads nothing ahead
    with pytest.raises(FomoeError, match="read ahead"):
        TierRates(0.6, 0.12, 0.28, ahead=1.5)
