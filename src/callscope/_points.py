"""Points: what a capture or patch can name, and how a capture selects them.

A *point* is a layer, named by where it sits in the call tree (`_record.py`
names them while the model runs: the caller's point, `/`, the layer's `name`), a
value sown in a layer's `call` (`<layer point>/<name>`), or one element of a
tuple, list or dict output (`<layer point>/<index or key>`). A *key* is
`point:kind` (kind `output`, `input` or `grad`; `input/<argument>` when a layer
takes several tensors), with `@i` when one point runs several times in a step. A
`Spec` is what one capture selects; it is hashable, so it can be part of a
compiled function's key. A layer's name or an element's key holding a character
that keys or globs use is percent-encoded in its point (`escaped`).
"""

from __future__ import annotations

import collections
import difflib
import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KINDS = ("output", "input", "grad")
# What keys (`point:kind`, `@i`, `/` between parts, `|` in step outputs) and
# `select` globs use: a sown name may not hold them.
RESERVED = ("/", ":", "@", "|", "#", "*", "?", "[", "]")
_ESCAPED = {c: f"%{ord(c):02X}" for c in ("%", *RESERVED)}  # (sown names: none of these)


def escaped(name: str) -> str:
    """`name` (a layer's, or an output element's key) as one part of a point:
    `%` and the characters of `RESERVED` percent-encoded, so that no name reads as
    another point (an output `{"d1@1": ...}` was the key of a shared `d1`'s second
    run, which was lost) and every glob matches it as it is written.

    >>> escaped("dense_1"), escaped("d1@1"), escaped("a/b:c%")
    ('dense_1', 'd1%401', 'a%2Fb%3Ac%25')
    """
    if not any(c in name for c in _ESCAPED):
        return name
    return "".join(_ESCAPED.get(c, c) for c in name)


def tree_points(model) -> list[str]:
    """The points of `model`'s layers from the tracked layer tree: what the call
    tree gives for layers called by the layer that holds them. For error messages;
    the names a run uses come from the calls themselves. Loop bodies left out."""
    return [point for point, loop in walk_tree(model) if loop is None]


def loop_points(model) -> dict[str, str]:
    """The tracked layers inside an RNN (its cell and the cell's layers), each to
    the RNN's point: whether or not a backend calls them, they are never points.
    (A model without an RNN has none: no walk, which names every layer.)"""
    import keras

    from callscope import _keras_compat

    if not any(isinstance(layer, keras.layers.RNN)
               for layer in _keras_compat.flatten_layers(model)):
        return {}
    return {point: loop for point, loop in walk_tree(model) if loop is not None}


def local_name(parent, child, attributes: Callable[[], dict] | None = None) -> str:
    """`child`'s own part of its point, under `parent`: its `name`, unless that is
    one Keras made up (`softmax_3`: a session-wide counter, different after
    every load) in a subclassed parent; then the attribute the parent holds it
    under (`_softmax` -> `softmax`), else its class name in snake case (a second
    such layer gets `#1`, `sublayer_parts`). Layers of a Functional or
    Sequential model keep their names: the model's config holds them.
    `attributes`: a function giving `_keras_compat.attribute_names` of `parent`
    and its children, kept by a caller naming several (most need none: one scan)."""
    from callscope import _keras_compat

    if parent is None or _keras_compat.is_graph_model(parent) \
            or not _keras_compat.has_automatic_name(child):
        return escaped(child.name)
    held = attributes() if attributes else _keras_compat.attribute_names(parent, [child])
    attribute = held.get(id(child))
    if attribute is not None:  # (a dict's key is in it: `heads_x/y`)
        return escaped(attribute)
    name = child.name
    base = name.rstrip("0123456789")
    return escaped(base[:-1] if base.endswith("_") and base != name else name)


def held_once(parent, children) -> Callable[[], dict]:
    """A function giving `_keras_compat.attribute_names(parent, children)`, read at
    its first call (most parents need none). A closure, not `functools.cache`,
    which torch.compile cannot trace: a graph break in every layer call."""
    from callscope import _keras_compat

    found = []

    def attributes():
        if not found:
            found.append(_keras_compat.attribute_names(parent, children))
        return found[0]

    return attributes


def sublayer_parts(parent) -> tuple[collections.Counter, dict[int, tuple[str, int]]]:
    """How many of `parent`'s sublayers have each own part (`local_name`), and
    each one's part and `n` among those of its part (a second gets `#1`), in the
    order `parent` tracks them (its attributes' order: the same in every call,
    every build and after a load), those no attribute holds last. Never the
    order they run in: two sublayers of one name (a subclassed model may have
    them) would swap points between calls that run them in another order,
    joining one's rows to the other's."""
    from callscope import _keras_compat

    layers = _keras_compat.child_layers(parent)
    attributes = held_once(parent, layers)
    children = [(child, local_name(parent, child, attributes)) for child in layers]
    counts = collections.Counter(own for _, own in children)
    if len(counts) < len(children):
        # Where parts repeat, those an attribute holds come first: Keras keeps
        # tracking a layer whose attribute was set again (a subclass's `__init__`
        # replacing `self.a`), and that one never runs.
        children.sort(key=lambda item: counts[item[1]] > 1
                      and id(item[0]) not in attributes())
    counts, places = collections.Counter(), {}
    for child, own in children:
        places[id(child)] = own, counts[own]
        counts[own] += 1
    return counts, places


def sublayer_basis(layers) -> tuple:
    """The part of `naming_basis` that a step checks cheaply: the ids and names of
    a parent's sublayers (`layers`)."""
    return tuple((id(child), child.name) for child in layers)


def naming_basis(parent) -> tuple:
    """What `sublayer_parts(parent)` reads: its sublayers' ids and names, and
    where it names or orders them by attribute (a name Keras made up, two of one
    name), the attributes that hold them. Equal bases, equal parts: a cache of
    the parts is good while its basis is (`del model.a` leaves `a` tracked, but
    no longer first)."""
    from callscope import _keras_compat

    layers = _keras_compat.child_layers(parent)
    basis = sublayer_basis(layers)
    if len({name for _, name in basis}) < len(basis) or (
            not _keras_compat.is_graph_model(parent)
            and any(_keras_compat.has_automatic_name(child) for child in layers)):
        basis += tuple(_keras_compat.attribute_names(parent, layers).items())
    return basis


def tree_ranks(top, own_part, skip=frozenset()) -> tuple:
    """(counts, ranks, seen): each layer under `top` (its sublayers' sublayers,
    and so on, depth first in the order each holds them) whose id is not in
    `skip`, by id, to its rank among those whose own part (`own_part(layer)`) is
    the same, and how many have each part; `seen`: the ids of all of them. A
    stable order for layers that a layer calls without holding them (two
    `Dense(name="d")` held by two blocks, both called by the model), walked here:
    Keras's `_flatten_layers` turns siblings round below the first level."""
    from callscope import _keras_compat

    counts, ranks, seen = collections.Counter(), {}, set()
    stack = list(reversed(_keras_compat.child_layers(top)))
    while stack:
        layer = stack.pop()
        if id(layer) in seen or layer is top:
            continue
        seen.add(id(layer))
        if id(layer) not in skip:
            own = own_part(layer)
            ranks[id(layer)] = counts[own]
            counts[own] += 1
        stack.extend(reversed(_keras_compat.child_layers(layer)))
    return counts, ranks, frozenset(seen)


def walk_tree(model):
    """(point, the point of the RNN it runs inside or None) of every tracked layer."""
    import keras

    from callscope import _keras_compat

    def walk(layer, point, loop):
        yield point, loop
        inner = point if loop is None and isinstance(layer, keras.layers.RNN) else loop
        places = sublayer_parts(layer)[1]
        for child in _keras_compat.child_layers(layer):
            own, n = places[id(child)]
            yield from walk(child, f"{point}/{own}{f'#{n}' if n else ''}", inner)

    yield from walk(model, escaped(model.name), None)


def key_name(point: str, kind: str, index: int, count: int) -> str:
    """The key of the `index`-th of `count` runs of `point` in one step."""
    return f"{point}@{index}:{kind}" if count > 1 else f"{point}:{kind}"


def normalize_select(select) -> tuple[str, ...] | Callable | None:
    """A glob, a list of globs, or a callable; raises a clear error otherwise."""
    if isinstance(select, str):
        return (select,)
    if isinstance(select, list):
        select = tuple(select)
    if select is not None and not callable(select):
        if not isinstance(select, tuple) or not all(isinstance(s, str) for s in select):
            raise TypeError(
                "`select` takes a glob, a list of globs or a callable (point, layer) -> "
                f"bool. Received: select={select!r}"
            )
    return select


def nearest(names, points: list[str]) -> list[str]:
    """The points closest to the mistyped `names`, for an error's hint (the first
    eight points when none is close)."""
    near = {p for name in names
            for p in difflib.get_close_matches(name, points, n=5, cutoff=0.2)}
    return sorted(near) or list(points[:8])


def single_calls(names, points: list[str]) -> dict[str, str]:
    """Those of `names` that name one call `point@i` of a point of `points` that
    runs more than once (a shared layer; `cs.points` lists each call so), each
    mapped to its point."""
    return {n: n.rpartition("@")[0] for n in names if n.rpartition("@")[0] in points}


def single_calls_hint(names, points: list[str], *, patching: bool = False) -> str:
    """The hint (or "") for `names` that name one call `point@i` of a point that
    runs more than once: select the point, or (`patching`) patch it."""
    calls = single_calls(names, points)
    if not calls:
        return ""
    whole = sorted(set(calls.values()))
    fix = (f"a patch applies to every call of its point: patch {whole} instead"
           if patching else
           f"select the point ({whole}), whose keys are `<point>@0:...`, `<point>@1:...`")
    return (f" {sorted(calls)} name single calls of a point that runs more than once (a "
            f"shared layer), as `cs.points` lists them: {fix}.")


def unmatched_globs(select, ran: list[str], who: str, where: str, rest: str) -> str | None:
    """The error for the globs of a list `select` that match none of the points
    `ran` (a typo; a shared layer's `point@1`, which names one of its calls), or
    None. Left out, they were lost in silence. (A single glob that matches
    nothing is the caller's "selected nothing" error.)"""
    if callable(select) or select is None or len(select) < 2:
        return None
    unmatched = [glob for glob in select
                 if not any(fnmatch.fnmatchcase(point, glob) for point in ran)]
    if not unmatched:
        return None
    hint = single_calls_hint(unmatched, ran)
    return (f"{who}: {unmatched} of the globs in `select` matched no point {where}.{hint} "
            f"Nearest points: {nearest(unmatched, ran)}; {rest}. Use `cs.points(model, x)` to "
            f"list every point. Received: select={list(select)!r}")


CALL_KINDS = {"fit": "train", "train_on_batch": "train", "evaluate": "test",
              "test_on_batch": "test", "predict": "predict", "predict_on_batch": "predict",
              "__call__": "call"}


class Ranges:
    """Histogram ranges found from the first batch of each kind of call (`train`,
    `test`, `predict`, `call`) in one capture: `{call kind: {key: (lo, hi)}}`.
    Filled once, before that kind's first step runs. Compiled steps take them as
    inputs (`_inputs.py`), so every `Ranges` is one key: captures whose first
    batches differ share one compiled function."""

    def __init__(self):
        self.found: dict[str, dict[str, tuple[float, float]]] = {}

    def pending(self, call_kind: str) -> bool:
        return call_kind not in self.found

    def __eq__(self, other):
        return isinstance(other, Ranges)

    def __hash__(self):
        return hash(Ranges)


def found_key(key: str, found) -> str | None:
    """The key among `found` whose range `key` uses: itself; else, for a point that
    ran more often in the step than in the eager pass (a custom step that calls a
    layer twice), the range of its first run; None if neither."""
    if key in found:
        return key
    point, _, kind = key.rpartition(":")
    base = point.rpartition("@")[0] or point
    return next((k for k in (f"{base}:{kind}", f"{base}@0:{kind}") if k in found), None)


@dataclass(frozen=True)
class Spec:
    """What one capture selects: hashable, so it can be part of a compiled key."""

    select: tuple[str, ...] | Callable | None
    kinds: tuple[str, ...]
    stats: tuple[str, ...] | None
    bins: int
    hist_range: tuple = ()  # ((kind or "*", lo, hi), ...): ranges given by the user
    ranges: Ranges | None = None  # ranges found from first batches, where not given
    owner: int = 0  # id of the model whose capture this is (points are named from it)

    def __post_init__(self):
        # The globs as compiled patterns, made here: `fnmatch.fnmatchcase` compiles
        # them behind a cache that torch.compile cannot trace (a graph break per
        # point); a compiled pattern's `match` it can.
        patterns = () if self.select is None or callable(self.select) else tuple(
            re.compile(fnmatch.translate(pattern)) for pattern in self.select)
        object.__setattr__(self, "_patterns", patterns)

    def selects(self, point: str, layer: Any, sown: bool) -> bool:
        if self.select is None:
            return sown
        if callable(self.select):
            return bool(self.select(point, layer))
        return any(pattern.match(point) is not None for pattern in self._patterns)

    def names(self, point: str | None) -> bool:
        """Does this spec name `point` exactly, rather than by a glob's pattern or a
        callable? A point named so is asked for itself: where it cannot give what
        is asked (it runs in a loop body; a gradient at a value that is not
        floating point), that is an error, where a glob leaves it out."""
        return isinstance(self.select, tuple) and point in self.select

    def given_range(self, kind: str) -> tuple[float, float] | None:
        for name, lo, hi in self.hist_range:
            if name in (kind, "*"):
                return lo, hi
        return None

    def range_for(self, key: str, call_kind: str) -> tuple[float, float]:
        """The histogram range of `key` in calls of `call_kind`: given for its kind,
        else found from the first batch (`Ranges`), else (-1, 1)."""
        given = self.given_range(key.rpartition(":")[2].partition("/")[0])
        if given is not None:
            return given
        found = self.ranges.found.get(call_kind, {}) if self.ranges is not None else {}
        name = found_key(key, found)
        return found[name] if name is not None else (-1.0, 1.0)

    def finds_ranges(self) -> bool:
        """Does a kind this spec records need its histogram range found?"""
        return bool(self.stats and "hist" in self.stats and self.ranges is not None
                    and any(self.given_range(k) is None for k in self.kinds))
