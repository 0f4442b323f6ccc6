"""Interventions: replace a point's output with `fn(value)` inside every call.

`cs.patch(model, {point: fn})` is a scope. Its `(point, fn)` pairs become part of
the model's compiled-function key, so a patched run compiles its own variant and
the unpatched one is untouched; nothing stays installed after the scope. `fn`
may close over arrays (activation patching: splice a clean run's activations into
a corrupted run). A new `fn` object is a new key, so reuse one function across
calls where you can.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from callscope import _scope


@contextlib.contextmanager
def patch(model, patches: Mapping[str, Callable[[Any], Any]]) -> Iterator[None]:
    """Replaces the output of each point with `fn(output)` for every call inside.

    Args:
        model: a `cs.Model`, `cs.Sequential` or `cs.enable`d model.
        patches: `{point: fn}`; a point is a layer's `layer.path` or a sown
            `layer.path + "/" + name` (see `cs.points`).

    Example:

    >>> import keras, numpy as np, callscope as cs
    >>> model = cs.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="hidden")],
    ...                       name="mlp")
    >>> with cs.patch(model, {"mlp/hidden": keras.ops.ones_like}):
    ...     model.predict(np.ones((1, 2)), verbose=0)
    array([[1., 1.]], dtype=float32)
    """
    from callscope._mixin import ContextMixin

    if not isinstance(model, ContextMixin):
        raise TypeError(
            "`cs.patch` needs a callscope model: build it with `cs.Model`/`cs.Sequential`, "
            f"or call `model = cs.enable(model)` first. Received: model={type(model).__name__}"
        )
    if not isinstance(patches, Mapping) or not patches:
        raise TypeError(
            "`cs.patch` takes a non-empty dict {point: fn}. "
            f"Received: patches={patches!r}"
        )
    for point, fn in patches.items():
        if not isinstance(point, str) or not callable(fn):
            raise TypeError(
                "`cs.patch` takes {point (str): fn (callable)}. "
                f"Received: {point!r}: {fn!r}"
            )
    state = model._cs
    ran = False
    with _scope.open_patch(model, dict(patches)):
        yield
        ran = True
    missed = [p for p in patches if p not in state.patch_hits]
    if ran and missed:
        known = model._cs_known_points()
        if any(p not in known for p in missed):
            near = sorted({n for p in missed for n in difflib.get_close_matches(p, known, n=4,
                                                                               cutoff=0.3)})
            raise ValueError(
                f"cs.patch never reached {missed}: no layer or sown value has that "
                f"point. Nearest points: {near or known[:8]}. Use `cs.points(model, x)` to "
                f"list them. Received: patches={list(patches)}"
            )
