"""A decode step's tables and grouped launches made in C (fomoepy/runtime/_driver_calls.c's DecodeLaunch,
used by fomoepy.runtime.gpu_launches where the binding's C functions are), and its routing (DecodeRoute:
the layer's router product, its top-k, the next layer's prediction, the read-back; GpuBackend.compiled_route):
through the real bindings over the stand-in drivers, with deferred streams (a stream runs only what a sync or an event needs), a model's
decode steps give the bits of the same steps made by the Python path (the same kernels with the same
arguments in the same order), with the device tier capped (steps split between the experts in slots and
those copied up: stages by stretch, then a combine), full (one grouped launch with the fused sum) and
empty (every expert streamed through a temporary slot); a routing with its prediction and one alone read
back the Python path's ids, weights and probabilities bit for bit. Bad arguments are refused."""

from __future__ import annotations

import pytest
from test_direct_calls import script_lines

SCRIPT = r"""
import sys
import numpy as np
sys.path.insert(0, "tests")
from conftest import ORACLE
from test_gpu_model import device_state, gpu_model
from fomoepy.experts.device import Phase
from fomoepy.runtime import gpu_launches, gpu_routing
from fomoepy.runtime._driver_calls import DecodeLaunch, DecodeRoute
from fomoepy.runtime.gpu import GpuBackend

dev = GpuBackend(sys.argv[1])
name = "qwen3moe_q4_k_m"
tokens = np.load(ORACLE / f"{name}.tokens.npy")


def decode(fraction):
    # prefill half the tokens, decode the rest: the decode steps' logits, and how many layers made theirs in C
    model, spec, experts = gpu_model(dev, name, fraction)
    state = device_state(dev, spec, 64)
    half = len(tokens) // 2
    model.forward(tokens[:half], state)
    out = [np.asarray(model.forward(np.array([t]), state, all_logits=True, phase=Phase.DECODE)) for t in tokens[half:]]
    compiled = [c for c in experts.launches._compiled if isinstance(c, DecodeLaunch)]
    routes = [r for r in experts._decode_routes if isinstance(r, DecodeRoute)]
    if fraction == 0.3 and routes:  # a step's routing and prediction, and a routing alone, both ways
        rng = np.random.default_rng(5)
        h = dev.upload(rng.standard_normal((1, spec.n_embd)).astype(np.float32))
        logits = dev.upload(rng.standard_normal((1, spec.moe.n_expert)).astype(np.float32))
        k = spec.moe.n_expert_used
        waits = dev.rt.syncs(dev.stream)
        dev._keepalive.append(b"bytes a copy queued before the routing may read")
        in_c = experts.route_ahead(0, h, experts.routers[0], "softmax", k)
        alone_c = dev.route(logits, "softmax", k)
        counted = dev.rt.syncs(dev.stream) - waits == 2 and not dev._keepalive  # each a wait, as the shim counts them
        kept_route, experts._decode_routes = experts._decode_routes, [False] * spec.n_layer
        kept_plain, dev._decode_routes = dev._decode_routes, {}
        gpu_routing.DecodeRoute, kept_type = None, gpu_routing.DecodeRoute
        in_python = experts.route_ahead(0, h, experts.routers[0], "softmax", k)
        alone_python = dev.route(logits, "softmax", k)
        experts._decode_routes, dev._decode_routes, gpu_routing.DecodeRoute = kept_route, kept_plain, kept_type
        def arrays(ahead, alone):
            (exact, guess), r = ahead, alone
            return exact.ids, exact.weights, exact.probs, guess, r.ids, r.weights, r.probs

        same = all(a.tobytes() == b.tobytes() for a, b in zip(arrays(in_c, alone_c), arrays(in_python, alone_python)))
        print("ROUTES", "SAME" if same else "DIFFERENT", len(routes) == spec.n_layer - 1, any(isinstance(r, DecodeRoute) for r in kept_plain.values()),
              counted)
    if fraction == 0.3 and compiled:  # a bad call is refused before any driver call
        k = spec.moe.n_expert_used
        for bad in (lambda: compiled[0].stages(0, k + 1, 0), lambda: compiled[0].tables([0] * (k + 1), [0.0] * (k + 1), {}, (), ())):
            try:
                bad()
                print("ACCEPTED")
            except ValueError:
                print("REFUSED")
    experts.close()
    return np.concatenate(out), len(compiled), spec.n_layer


for fraction in (0.3, 1.0, 0.0):
    in_c, n_c, n_layer = decode(fraction)
    gpu_launches.DecodeLaunch, kept, gpu_routing.DecodeRoute, kept_route = None, gpu_launches.DecodeLaunch, None, gpu_routing.DecodeRoute
    dev._decode_routes.clear()
    in_python, n_python, _ = decode(fraction)
    gpu_launches.DecodeLaunch, gpu_routing.DecodeRoute = kept, kept_route
    dev._decode_routes.clear()
    print(fraction, "SAME" if in_c.tobytes() == in_python.tobytes() else "DIFFERENT", n_c == n_layer, n_python == 0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_decode_steps_launched_in_c_give_the_python_paths_bits(standin, vendor):
    lines = script_lines(standin, vendor, SCRIPT, FOMOE_STANDIN_DEFERRED="1")
    assert lines[:3] == ["ROUTES SAME True True True", "REFUSED", "REFUSED"], lines
    assert lines[3:] == [f"{f} SAME True True" for f in (0.3, 1.0, 0.0)], lines
