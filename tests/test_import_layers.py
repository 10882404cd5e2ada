"""The package's imports, top-level and inside functions alike, form no cycle through the engine, its
options, the MoE step and its streamer, the backends or the expert devices: the step drives the devices
through fomoepy.experts.device, and nothing below the engine imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fomoepy"
LAYERED = {
    "fomoepy.engine", "fomoepy.options", "fomoepy.experts.step", "fomoepy.experts.streamer", "fomoepy.experts.device",
    "fomoepy.runtime.backends", "fomoepy.runtime.cpu_experts", "fomoepy.runtime.ggml_experts", "fomoepy.runtime.gpu_experts",
}  # fmt: skip


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fomoepy"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("fomoepy"))
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_through_the_engine_the_step_or_the_backends():
    graph = import_graph()
    assert LAYERED <= graph.keys(), LAYERED - graph.keys()
    bad = [sorted(c) for c in cycles(graph) if c & LAYERED]
    assert not bad, f"import cycles: {bad}"


def test_the_cycle_check_sees_an_import_inside_a_function():
    graph = import_graph()
    graph["fomoepy.options"] = graph["fomoepy.options"] | {"fomoepy.engine"}  # the old open_engine's import
    assert any({"fomoepy.options", "fomoepy.engine"} <= c for c in cycles(graph))


def test_the_expert_devices_know_the_interface_not_the_step():
    graph = import_graph()
    for device in ("fomoepy.runtime.cpu_experts", "fomoepy.runtime.ggml_experts", "fomoepy.runtime.gpu_experts"):
        assert "fomoepy.experts.device" in graph[device], device
        assert not graph[device] & {"fomoepy.experts.step", "fomoepy.experts.streamer", "fomoepy.experts.cache"}, device
