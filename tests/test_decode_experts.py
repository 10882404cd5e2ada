"""A step's device work on one GPU made in C (fomoepy/runtime/_decode_experts.c's DecodeExperts: GpuExperts's
begin, compute, download and evict, each one call over GpuExperts's own books), against GpuExperts's Python
methods, the definition: through the real bindings over the stand-in drivers, with deferred streams (a
stream runs only what a sync or an event needs, so a missing wait shows in the bits), the two make the
same driver calls with the same arguments in the same order (every call logged by the binding's Calls,
addresses named by first appearance), and a model's decode steps give the same bits.

Two set-ups cover the paths: the engine over a store (reads land in pinned buffers and are copied up from
there, the host tier takes the device tier's evictees through copies down, the next layer's guesses are
read ahead), with the device tier capped (steps split between the experts in slots and those copied up),
full (one grouped launch) and empty (every expert streamed through a temporary slot); and a GGUF source
with no reader pool (its bytes come at the step's end and go up through the staging ring) under a demoting
policy. Reads land as they are asked for, so both paths see one order of landings."""

from __future__ import annotations

import pytest
from test_direct_calls import script_lines

SCRIPT = r"""
import sys, tempfile
import numpy as np
sys.path.insert(0, "tests")
from conftest import ORACLE
from test_gpu_model import device_state
from fomoepy.engine import Engine
from fomoepy.experts.cache import ExpertCache
from fomoepy.experts.device import Phase
from fomoepy.experts.policy import make_policy
from fomoepy.experts.reads import Read
from fomoepy.experts.routing import Routing
from fomoepy.experts.source import GGUFExpertSource
from fomoepy.experts.step import MoEStep
from fomoepy.experts.store_reader import ExpertStore
from fomoepy.experts.store_writer import prepare_store
from fomoepy.experts.streamer import ExpertStreamer
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec
from fomoepy.model.transformer import Transformer, load_weights
from fomoepy.options import EngineOptions
from fomoepy.runtime import gpu_experts
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.gpu_experts import GpuExperts, gpu_expert_nbytes

# reads made as they are asked for (landed at once, in order): a pool's threads land them in whichever order
# they finish, and the copies up follow the landings
ExpertStore.submit = lambda self, layer, expert, out=None, copy=None: Read.landed(self.read_into(layer, expert, out, copy))

vendor = sys.argv[1]
name = "qwen3moe_q4_k_m"
path = ORACLE / f"{name}.gguf"
tokens = np.load(ORACLE / f"{name}.tokens.npy")
half = len(tokens) // 2
gf = GGUFFile(path)
spec = ModelSpec.from_gguf(gf)
source = GGUFExpertSource(gf, spec)
unit = [gpu_expert_nbytes(layer) for layer in source.layers]
device_all = sum(unit) * spec.moe.n_expert
host_all = sum(layer.expert_nbytes for layer in source.layers) * spec.moe.n_expert
Compiled = gpu_experts.DecodeExperts


def canonical(log, pinned):
    # each device address and pinned host address named by its first appearance; other host memory (a
    # table's bytes, a launch's parameter block) one name: the two paths compare up to where memory landed
    names = {}
    def name(v):
        return v if v < 1 << 16 else names.setdefault(v, len(names))
    out = []
    for call in log:
        kind, args = call[0], list(call[1:])
        if kind == "htod":
            args[1] = name(args[1]) if pinned(args[1]) else "host"
        elif kind == "dtoh":
            args[0] = name(args[0]) if pinned(args[0]) else "host"
        elif kind == "launch":  # (through the driver call itself: its last argument is a host parameter block)
            args[-1] = "params"
        out.append((kind,) + tuple(a if isinstance(a, str) else name(a) for a in args))
    return out


def decode(step, calls, device):
    # prefill half the tokens, decode the rest one by one, the calls of the decode steps logged
    out, log = [], []
    calls.log = log
    try:
        for t in tokens[half:]:
            out.append(np.asarray(step(int(t))))
    finally:
        calls.log = None
    steps = device._steps
    made = (steps.steps_begun, steps.steps_computed) if isinstance(steps, Compiled) else (0, 0)
    pool = device.pool
    return np.concatenate(out), canonical(log, lambda v: pool is not None and pool.pins(v, 1)), made, (device.uploads, device.downloads)


def engine_run(vram, compiled):
    gpu_experts.DecodeExperts = Compiled if compiled else None
    try:
        engine = Engine(path, EngineOptions(backend=vendor, store=(store,), vram_cache=int(vram * device_all), ram_cache=int(0.5 * host_all)))
        state = engine.new_state()
        engine.eval(state, list(tokens[:half]))
        device = engine.experts.device
        out = decode(lambda t: engine.decode_token(state, t), device.dev.rt.direct, device)
        engine.close()
        return out
    finally:
        gpu_experts.DecodeExperts = Compiled


def gguf_run(compiled):
    # a device tier of 30 %, a host tier of every expert under a demoting policy, reads at the step's end
    gpu_experts.DecodeExperts = Compiled if compiled else None
    try:
        dev = GpuBackend(vendor)
        cache = ExpertCache(spec.moe.n_expert, [layer.expert_nbytes for layer in source.layers], int(0.3 * device_all), host_all,
                            device_policy=make_policy("lfu-demote"), host_policy=make_policy("lfu-demote"), device_expert_bytes=unit)
        weights = load_weights(gf, spec, dev)
        device = GpuExperts(source.layers, dev, weights.routers())
        streamer = ExpertStreamer(source, cache, spec.moe.n_expert_used, EngineOptions(prefetch=False), download=device.download)
        model = Transformer(spec, weights, dev, MoEStep(streamer, device))
        state = device_state(dev, spec, 64)
        model.forward(tokens[:half], state)
        out = decode(lambda t: model.forward(np.array([t]), state, all_logits=True, phase=Phase.DECODE), dev.rt.direct, device)
        device.close()
        return out
    finally:
        gpu_experts.DecodeExperts = Compiled


class Landing:
    # a source whose reads land as they are asked for, with no pool of its own: a step's reads come one by one
    # (as_they_land), in the order they were asked for

    def __init__(self, source):
        self.source, self.layers = source, source.layers

    def read(self, layer, expert):
        return self.source.read(layer, expert)

    def submit(self, layer, expert):
        return Read.landed(self.source.read(layer, expert))


def direct_run(compiled):
    # decode steps of every layer made one after another with no routing between them (the router's read-back
    # is where the host waits for the device): a copy into a slot that launches not yet waited for may still
    # read waits for them on the device
    gpu_experts.DecodeExperts = Compiled if compiled else None
    try:
        dev = GpuBackend(vendor)
        cache = ExpertCache(spec.moe.n_expert, [layer.expert_nbytes for layer in source.layers], int(0.3 * device_all), host_all // 2,
                            device_policy=make_policy("lfu-demote"), host_policy=make_policy("lfu-demote"), device_expert_bytes=unit)
        weights = load_weights(gf, spec, dev)
        device = GpuExperts(source.layers, dev, weights.routers())
        # pinned chunks of a few buffers: the copies down soon take buffers given back (the host tier's
        # evictees), once the pool knows their copies are done (the join marks a wait has passed)
        device.pool.chunk_bytes = 3 * max(unit)
        step = MoEStep(ExpertStreamer(Landing(source), cache, spec.moe.n_expert_used, EngineOptions(prefetch=False), download=device.download),
                       device)  # fmt: skip
        rng = np.random.default_rng(7)
        k, E = spec.moe.n_expert_used, spec.moe.n_expert
        h = dev.upload(rng.standard_normal((1, spec.n_embd)).astype(np.float32))
        # one step fails between its begin and its compute (its record of the routing raises): the next
        # step's begin gives the slots it took back
        note, notes = step.streamer.note, [0]

        def failing_note(*args):
            notes[0] += 1
            if notes[0] == 20:
                raise RuntimeError("a step that fails after its begin")
            return note(*args)

        step.streamer.note = failing_note
        outs, log = [], []
        dev.rt.direct.log = log
        for t in range(12):
            step.begin_step(Phase.DECODE)
            for layer in range(spec.n_layer):
                ids = np.sort(rng.choice(E, k, replace=False))[None, :].astype(np.int64)
                weights_ = rng.random((1, k)).astype(np.float32)
                try:
                    outs.append(step(layer, h, Routing(ids, weights_, np.full((1, E), 1.0 / E, np.float32))))
                except RuntimeError as e:
                    assert "fails after its begin" in str(e), e
            step.end_step(1)
        dev.rt.direct.log = None
        bits = np.concatenate([o.to_host() for o in outs])
        steps = device._steps
        made = (steps.steps_begun, steps.steps_computed) if isinstance(steps, Compiled) else (0, 0)
        out = bits, canonical(log, lambda v: device.pool.pins(v, 1)), made, (device.uploads, device.downloads)
        device.close()
        return out
    finally:
        gpu_experts.DecodeExperts = Compiled


def compare(what, c, python, n_steps=(len(tokens) - half) * spec.n_layer, dropped=0):
    (bits_c, calls_c, made_c, moved_c), (bits_p, calls_p, made_p, moved_p) = c, python
    # the decode steps begun and computed in C: all but each layer's first (its DecodeLaunch is made then, by the
    # Python path) and those with no expert held or at hand (nothing to begin: the Python path's compute); none
    # in the Python run. `dropped`: steps that failed between their begin and their compute
    in_c = made_c[0] - dropped == made_c[1] >= 3 * n_steps // 4 and made_p == (0, 0)
    print(what, "SAME" if bits_c.tobytes() == bits_p.tobytes() else "DIFFERENT", "CALLS SAME" if calls_c == calls_p else "CALLS DIFFERENT",
          in_c, moved_c == moved_p, moved_c[1] > 0)


store = tempfile.mkdtemp()
prepare_store(path, [store], progress=False)
for vram in (0.3, 1.0, 0.0):
    compare(f"store {vram}", engine_run(vram, True), engine_run(vram, False))
compare("gguf 0.3", gguf_run(True), gguf_run(False))
compare("direct", direct_run(True), direct_run(False), 12 * spec.n_layer, dropped=1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_a_steps_device_work_in_c_makes_the_python_paths_calls_and_bits(standin, vendor):
    lines = script_lines(standin, vendor, SCRIPT, FOMOE_STANDIN_DEFERRED="1")
    # (copies down at a 30 % device tier; with every expert held, or none kept, nothing is evicted)
    assert lines == ["store 0.3 SAME CALLS SAME True True True", "store 1.0 SAME CALLS SAME True True False",
                     "store 0.0 SAME CALLS SAME True True False", "gguf 0.3 SAME CALLS SAME True True True",
                     "direct SAME CALLS SAME True True True"], lines  # fmt: skip
