"""An actor touches only its own fields: the GatherActor reaches a StreamActor through the
stream's own methods (``launch_now`` for a plain call, the directory's ``send`` for a
message), never through its lane, route, stream or turn."""

from __future__ import annotations

import ast
import inspect

from kvactors.actors import gather

# What the GatherActor may call on a StreamActor.
_STREAM_FACE = {"launch_now"}


def _stream_names(fn: ast.FunctionDef) -> set[str]:
    # Local names bound to a StreamActor: ``stream = self._streams.peek(...)`` and the like.
    names: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Attribute)
                and func.value.attr == "_streams"
            ):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_the_gather_actor_reaches_a_stream_actor_only_through_its_methods() -> None:
    tree = ast.parse(inspect.getsource(gather))
    reached: list[tuple[str, str]] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        names = _stream_names(fn) | {"stream"}
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in names
            ):
                reached.append((fn.name, node.attr))
    assert reached, "no access to a StreamActor found: the scan is stale"
    assert {attr for _, attr in reached} <= _STREAM_FACE, reached


def test_the_scan_sees_a_field_reached_across_actors() -> None:
    # The scan fails on what the rule forbids (the GatherActor reading the stream's lane).
    src = "def f(self):\n    stream = self._streams.peek(0)\n    return stream.lane.jobs\n"
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert "stream" in _stream_names(fn)
    attrs = {
        n.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "stream"
    }
    assert not attrs <= _STREAM_FACE
