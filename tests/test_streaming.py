"""Rung 4 of the correctness ladder: the streamed path (any tier mix, CAR off) equals the all-resident
path bit for bit on the CPU backend; and the streaming features (store, CAR, backfill, prefetch,
traces, profiles) work end to end through the engine. When a step's reads are issued, and what it
does while they are in flight, is tests/test_streaming_reads.py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.engine import Engine, EngineOptions
from fomoepy.experts.car import CarConfig
from fomoepy.experts.device import Phase
from fomoepy.experts.policy import DEFAULT_POLICY, policy_demotes
from fomoepy.experts.profile import read_freq, write_freq
from fomoepy.experts.trace import read_trace
from fomoepy.runtime.cpu_experts import ready_expert_nbytes
from fomoepy.sampling import SamplingParams


@pytest.fixture
def model(streamed_model):
    """(the model file, its store's two directories, the oracle's tokens, the all-resident logits)."""
    return streamed_model


def one_expert(path, policy: str = DEFAULT_POLICY, host_tier: bool = True) -> tuple[int, int]:
    """One expert's bytes in the reference backend's device tier under `policy`, and in the host tier.
    Its device experts keep their store bytes only where a demoting policy has a host tier to demote into."""
    e = Engine(path, EngineOptions(vram_cache=0))
    layer = e.source.layers[0]
    return ready_expert_nbytes(layer, policy_demotes(policy) and host_tier), layer.expert_nbytes


@pytest.mark.parametrize(
    "vram, ram, policy, use_store",
    [
        (0, 0, "lru", False),
        (1, 0, "lru", False),
        (1, 1, "lru", True),
        (0, 1, "lfu-decay", True),
        (3, 5, "lfu-decay", True),
        (3, 5, "lfu-demote", True),
        (None, None, "lru", True),
    ],
)
def test_streamed_logits_equal_all_resident_bit_for_bit(model, vram, ram, policy, use_store):
    path, store, tokens, resident = model
    dev_unit, host_unit = one_expert(path, policy, host_tier=ram != 0)
    opts = EngineOptions(
        store=tuple(store) if use_store else (),
        vram_cache=None if vram is None else vram * dev_unit,
        ram_cache=None if ram is None else ram * host_unit,
        cache_policy=policy,
    )
    engine = Engine(path, opts)
    # prefill once, then token by token through the same small cache
    assert np.array_equal(engine.logits(tokens), resident)
    state = engine.new_state()
    half = len(tokens) // 2
    stepped = [engine.eval(state, tokens[:half], all_logits=True)]
    stepped += [engine.eval(state, tokens[i : i + 1], all_logits=True, phase=Phase.DECODE) for i in range(half, len(tokens))]
    reference_state = Engine(path, EngineOptions()).new_state()
    ref = Engine(path, EngineOptions())
    expected = [ref.eval(reference_state, tokens[:half], all_logits=True)]
    expected += [ref.eval(reference_state, tokens[i : i + 1], all_logits=True, phase=Phase.DECODE) for i in range(half, len(tokens))]
    assert np.array_equal(np.concatenate(stepped), np.concatenate(expected))
    assert_conserved(engine.stats()["cache"])
    engine.close()


def assert_conserved(s: dict) -> None:
    """Every expert use is a hit or a miss of the first enabled tier; each miss of a tier is a hit or a
    miss of the next enabled one; each miss of the last one is one disk read."""
    assert s["accesses"] > 0
    reaching = s["accesses"]
    for tier in ("device", "host"):
        if s[tier]["enabled"]:
            assert s[tier]["hits"] + s[tier]["misses"] == reaching, tier
            reaching = s[tier]["misses"]
        else:
            assert s[tier]["hits"] == s[tier]["misses"] == 0, tier
    assert s["disk"]["reads"] == reaching


def test_small_cache_misses_and_reports_hit_rates(model):
    path, store, tokens, _ = model
    dev_unit, host_unit = one_expert(path)
    engine = Engine(path, EngineOptions(store=tuple(store), vram_cache=2 * dev_unit, ram_cache=4 * host_unit))
    state = engine.new_state()
    for t in tokens[:12]:  # token by token: n_expert_used experts per MoE layer per token
        engine.decode_token(state, int(t))
    s = engine.stats()["cache"]
    n_moe = engine.spec.n_layer
    assert s["accesses"] == 12 * n_moe * engine.spec.moe.n_expert_used
    assert_conserved(s)
    # 2 experts fit the device tier and 4 the host tier, of n_layer x n_expert: most uses go to the disk
    assert s["device"]["admitted"] - s["device"]["evicted"] <= 2 and s["disk"]["reads"] > s["accesses"] // 2
    line = engine.stats_lines()[0]  # what `fomoe generate` prints: the same figures
    assert f"{s['accesses']} uses" in line and f"device {s['device']['hit_rate']:.1%} hit" in line
    assert f"host {s['host']['hit_rate']:.1%} hit" in line and f"({s['disk']['reads']} reads" in line
    engine.close()


def greedy_tokens(path, opts: EngineOptions, prompt, n=24):
    engine = Engine(path, opts)
    out = list(engine.generate(prompt, n, SamplingParams(temperature=0.9, seed=5), stop_at_eog=False))
    stats = engine.stats()
    engine.close()
    return out, stats


def test_car_with_sync_backfill_is_repeatable_and_reports_substitutions(model):
    path, store, tokens, _ = model
    dev_unit, host_unit = one_expert(path)
    opts = EngineOptions(
        store=tuple(store),
        vram_cache=4 * dev_unit,
        ram_cache=12 * host_unit,
        # the test models' routers are sharp (no near-ties), so only a low threshold substitutes
        car=CarConfig(threshold=1e-4, dampen=True),
        backfill="sync",
        backfill_per_token=2,
    )
    a, stats_a = greedy_tokens(path, opts, tokens[:8].tolist())
    b, stats_b = greedy_tokens(path, opts, tokens[:8].tolist())
    assert a == b
    assert stats_a["car"]["substitution_rate"] > 0
    # every count but the reads made ahead, which depend on when reads land (how many guesses were issued
    # before their layer routed); the tiers never see them, so the cache's counts are repeatable
    timing = ("issued", "used", "landed", "wasted", "in_the_way", "skipped")
    for stats in (stats_a, stats_b):
        stats["prefetch"] = {c: v for c, v in stats["prefetch"].items() if c not in timing}
    assert stats_a == stats_b


def test_car_off_generates_the_exact_model_tokens(model):
    path, store, tokens, _ = model
    dev_unit, host_unit = one_expert(path)
    exact, _ = greedy_tokens(path, EngineOptions(), tokens[:8].tolist())
    small, _ = greedy_tokens(path, EngineOptions(store=tuple(store), vram_cache=dev_unit, ram_cache=host_unit), tokens[:8].tolist())
    assert exact == small


def test_trace_records_original_choices_and_profile_seeds_the_device_tier(model, tmp_path):
    path, store, tokens, _ = model
    trace_path = tmp_path / "t.trace"
    engine = Engine(path, EngineOptions(trace=str(trace_path)))
    engine.logits(tokens[:10])
    profile = engine.experts.streamer.counter.profile()
    engine.close()
    trace = read_trace(trace_path)
    assert trace.n_tokens == 10
    assert len(trace.records) == engine.spec.n_layer
    assert not trace.truncated

    freq = tmp_path / "m.freq"
    write_freq(freq, profile)
    loaded = read_freq(freq, engine.spec.n_layer, engine.spec.moe.n_expert)
    dev_unit, _ = one_expert(path)
    seeded = Engine(path, EngineOptions(vram_cache=3 * dev_unit, freq_profile=str(freq)))
    top3 = [(int(l), int(e)) for l, e, _ in loaded.items()[:3]]
    assert sorted(seeded.experts.device.ready) == sorted(top3)
    # what `fomoe generate` prints says so (a profile's header names no model)
    assert f"profile {freq}: seeded 3 experts into the device tier, 0 into the host tier" in seeded.stats_lines()
    seeded.close()


def test_device_tier_holds_what_its_budget_allows_in_compute_ready_bytes(model):
    """Without a host tier (no store, no --ram-cache) a demoting policy has nowhere to demote to: the
    device experts keep no store bytes, and the tier's unit counts none (it once did, and held fewer)."""
    path, store, tokens, _ = model
    dev_unit, _ = one_expert(path, host_tier=False)
    engine = Engine(path, EngineOptions(vram_cache=3 * dev_unit))
    engine.logits(tokens)
    tier = engine.experts.streamer.cache.device
    assert len(engine.experts.device.ready) == len(tier) == 3
    assert tier.used == 3 * dev_unit <= tier.capacity
    engine.close()


@pytest.mark.parametrize("policy, kept", [("lru-pinned", True), ("lfu-decay-pinned", True), ("lru", False)])
def test_pinned_policies_keep_the_profiles_seeds_in_the_engine(tmp_path, policy, kept):
    # the profile ranks the experts the text uses least first: a policy that only follows use evicts them
    path = ORACLE / "qwen3moe_q4_k_m.gguf"
    tokens = np.load(ORACLE / "qwen3moe_q4_k_m.tokens.npy")
    probe = Engine(path, EngineOptions())
    probe.logits(tokens)
    counts = probe.experts.streamer.counter
    rarest = [(l, int(e)) for l in range(counts.counts.shape[0]) for e in np.argsort(counts.counts[l], kind="stable")[:2]]
    profile_path = tmp_path / "p.freq"
    for key in rarest:  # counts that put these keys first
        counts.counts[key] = 10_000
    write_freq(profile_path, counts.profile())
    dev_unit, _ = one_expert(path)
    # 12 device slots, half of them pinned: the 6 rarest experts, held for good by a *-pinned policy
    engine = Engine(path, EngineOptions(vram_cache=12 * dev_unit, cache_policy=policy, freq_profile=str(profile_path)))
    state = engine.new_state()
    for t in tokens:
        engine.decode_token(state, int(t))
    held = {(l, e) for l in range(engine.spec.n_layer) for e in engine.experts.streamer.cache.resident(l)}
    assert set(rarest) <= held if kept else not set(rarest) <= held
    engine.close()


@pytest.mark.parametrize("policy", ["lfu-admit", "lfu-demote", "lfu-cooc", "lru", "layer-lru"])
def test_the_simulator_replays_the_engines_hit_rates(model, tmp_path, policy):
    # the same text token by token through the engine (tiers capped, prefetch off) and through the
    # simulator on the engine's own trace: per-tier hit rates within 1 point (they are the same code)
    from fomoepy.experts.simulate import simulate

    path, store, tokens, _ = model
    dev_unit, host_unit = one_expert(path, policy)
    trace_path = tmp_path / "t.trace"
    opts = EngineOptions(store=tuple(store), vram_cache=6 * dev_unit, ram_cache=10 * host_unit, cache_policy=policy,
                         trace=str(trace_path), prefetch=False)  # fmt: skip
    engine = Engine(path, opts)
    state = engine.new_state()
    for t in tokens:
        engine.decode_token(state, int(t))
    measured = engine.stats()["cache"]
    sizes = [layer.expert_nbytes for layer in engine.source.layers]
    device_sizes = [ready_expert_nbytes(layer, policy_demotes(policy)) for layer in engine.source.layers]
    engine.close()
    sim = simulate(read_trace(trace_path), sizes, 6 * dev_unit, 10 * host_unit, policy, device_expert_bytes=device_sizes).summary
    for tier in ("device", "host"):
        assert abs(measured[tier]["hit_rate"] - sim[tier]["hit_rate"]) <= 0.01, (tier, measured[tier], sim[tier])
    assert measured["accesses"] == sim["accesses"] and measured["disk"]["reads"] > 0
    assert (measured["host"]["demoted"] > 0) == policy_demotes(policy)


def test_reading_ahead_changes_no_tier_and_the_replay_of_its_trace_matches(model, tmp_path):
    # prefetch on and off: the tiers see the same plans (a read made ahead is counted as the disk read it
    # is), so every counter is the same, and the replay of the prefetching run's trace matches both
    from fomoepy.experts.simulate import simulate

    path, store, tokens, _ = model
    dev_unit, host_unit = one_expert(path, "lfu-cooc")
    measured = []
    for prefetch in (True, False):
        trace_path = tmp_path / f"t{prefetch}.trace"
        engine = Engine(path, EngineOptions(store=tuple(store), vram_cache=4 * dev_unit, ram_cache=8 * host_unit,
                                            trace=str(trace_path), prefetch=prefetch))  # fmt: skip
        state = engine.new_state()
        for t in tokens:
            engine.decode_token(state, int(t))
        measured.append(engine.stats())
        sizes = [layer.expert_nbytes for layer in engine.source.layers]
        device_sizes = [ready_expert_nbytes(layer, True) for layer in engine.source.layers]
        engine.close()
        if prefetch:
            trace = read_trace(trace_path)
    ahead = measured[0]["prefetch"]
    assert trace.header.read_ahead and ahead["used"] > 0 and ahead["wasted"] > 0 and measured[1]["prefetch"]["issued"] == 0
    replay = simulate(trace, sizes, 4 * dev_unit, 8 * host_unit, device_expert_bytes=device_sizes).summary
    counted = ("hits", "misses", "admitted", "evicted", "demoted")
    for tier in ("device", "host"):
        on, off = ({c: m["cache"][tier][c] for c in counted} for m in measured)
        assert on == off == {c: replay[tier][c] for c in counted}, tier
    assert measured[0]["cache"]["disk"] == measured[1]["cache"]["disk"]
    accuracy, predicted = trace.prediction_accuracy()
    assert predicted == ahead["predicted"] and accuracy == pytest.approx(ahead["accuracy"])


def test_a_demoting_policy_moves_device_evictees_into_the_host_tier_with_their_bytes(model):
    # lfu-demote through the engine on the store: the device tier evicts, the evicted experts' store bytes
    # come from the device tier's copy (no disk read) into the host tier, and later uses hit them there
    path, store, tokens, _ = model
    dev_unit, host_unit = one_expert(path, "lfu-demote")
    engine = Engine(path, EngineOptions(store=tuple(store), vram_cache=3 * dev_unit, ram_cache=40 * host_unit,
                                        cache_policy="lfu-demote", prefetch=False))  # fmt: skip
    streamer = engine.experts.streamer
    reads = []
    read, submit = streamer.source.read, streamer.source.submit
    streamer.source.read = lambda layer, expert: reads.append((layer, expert)) or read(layer, expert)
    streamer.source.submit = lambda layer, expert, *a, **kw: reads.append((layer, expert)) or submit(layer, expert, *a, **kw)
    state = engine.new_state()
    for t in tokens:
        engine.decode_token(state, int(t))
    s = engine.stats()["cache"]
    assert s["host"]["demoted"] > 0 and s["host"]["hits"] > 0
    assert len(reads) == s["disk"]["reads"]  # a demotion reads nothing from the disk
    for key, parts in streamer.host_slots.items():
        assert all(np.array_equal(a, b) for a, b in zip(parts, read(*key)))
    engine.close()
