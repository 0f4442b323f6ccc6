"""Discovery: every point of a model, and the call tree of a subclassed model.

`plot_model` and `model.summary()` only see what Keras tracks: for a subclassed
model that is a flat list of attributes, not the order or nesting of calls. Here
the model runs once, eagerly, on a sample batch with every layer's `call` wrapped,
so the tree is what actually ran: nested layers, output shapes, parameter counts,
the context arguments each layer receives, and the values it sows.
"""

from __future__ import annotations

import keras

from callscope import _backend, _keras_compat, _record, _steps
from callscope._points import Spec

_EVERYTHING = Spec(select=lambda point, layer: True, kinds=("output",), stats=None, bins=1)


def _run(model, x):
    """The calls' records of `model(x)`. What the call assigns (a stateful RNN's
    state) goes into a `keras.StatelessScope`, and is dropped: listing the points
    leaves a built model as it was."""
    _steps.check_not_rematerialized(model)
    if not model.built:
        # A plain call: builds, records nothing; in the model's strategy's scope,
        # as Keras builds it (`_backend.strategy_scope`).
        # (Not in a StatelessScope, where Keras makes no variables: what this
        # call assigns stays, as a first call of the user's would leave it.)
        with _record.collecting_for(()), _backend.strategy_scope(model):
            model(x, training=False)
    _record.install_wrappers(model)
    with _record.collecting_for((_EVERYTHING,)) as collector, keras.StatelessScope():
        collector.discovery = True
        model(x, training=False)
    return collector.tree


def _shape(value):
    if hasattr(value, "shape"):
        return tuple(value.shape)
    if isinstance(value, (bool, int, float)):  # a sown number: one tensor, recorded
        return ()
    if value is None or value is _record.LOOP:
        return None
    return keras.tree.map_structure(lambda v: tuple(v.shape) if hasattr(v, "shape") else None,
                                    value)


def points(model, x) -> dict[str, tuple]:
    """Every point of `model` (layers and sown values) and its output shape.

    Runs `model(x)` once, eagerly, and leaves a built model's state as it was (a
    stateful RNN's; an unbuilt one is built by a call first, which assigns it as a
    call does). A layer called several times is listed once per
    call, as `point@i`, the way `cs.capture` keys it. A layer with a tuple, list or
    dict output is listed with the structure of shapes, and each element as its
    own point. Layers inside a loop body (an RNN's cell) are not points.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="hidden")],
    ...                       name="mlp")
    >>> cs.points(model, np.ones((4, 2)))
    {'mlp': (4, 3), 'mlp/hidden': (4, 3)}
    """
    calls: dict[str, list] = {}
    for _, point, _, value, _ in _preorder(_run(model, x)):
        if value is not _record.LOOP:  # inside a loop body: not a point
            calls.setdefault(point, []).append(_shape(value))
    out = {}
    for point, shapes in calls.items():
        if len(shapes) == 1:
            out[point] = shapes[0]
        else:
            out.update({f"{point}@{i}": s for i, s in enumerate(shapes)})
    return out


def _context_args(layer) -> str:
    names = sorted(_keras_compat.registered_call_context_args(layer) - {"training"})
    return ", ".join(names)


def summary(model, x, print_fn=print) -> str:
    """Prints the call tree of any model, subclassed ones included, and returns it.

    For each call: the point, output shape, parameter count of the layer (its own
    and its children's) and the context arguments it receives; sown values are
    listed under the layer that sowed them.

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="hidden")],
    ...                       name="mlp")
    >>> _ = cs.summary(model, np.ones((4, 2)), print_fn=lambda s: None)
    """
    tree = _run(model, x)
    # The collector appends a layer when its call returns: children come first.
    # Re-order parents before their children, by depth and position.
    ordered = _preorder(tree)
    rows = [("call", "output shape", "params", "context args")]
    looped = set()
    for depth, point, layer, value, sown in ordered:
        if value is _record.LOOP:  # one row, however many times the loop ran it
            if point in looped:
                continue
            looped.add(point)
        label = "  " * depth + (f"sow {point.rsplit('/', 1)[-1]}" if sown else
                                f"{point} ({type(layer).__name__})")
        params = "" if sown else f"{_count_params(layer):,}"
        context = "" if sown else _context_args(layer)
        shape = "inside a loop: not a point" if value is _record.LOOP else str(_shape(value))
        rows.append((label, shape, params, context))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    text = "\n".join(lines)
    print_fn(text)
    return text


def _preorder(tree):
    """Turns post-order (children first) records into pre-order for display."""
    result = []
    pending: list[list] = [[]]
    for depth, point, layer, value, sown in tree:
        while len(pending) <= depth + 1:
            pending.append([])
        children = pending[depth + 1]
        pending[depth + 1] = []
        entry = [(depth, point, layer, value, sown)] + children
        pending[depth].extend(entry)
    for level in pending:
        result.extend(level)
    return result


def _count_params(layer) -> int:
    try:
        return int(layer.count_params())
    except ValueError:
        return 0

