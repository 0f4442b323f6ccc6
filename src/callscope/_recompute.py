"""torch: a checkpoint's recompute applies the patches its own forward pass applied.

`torch.utils.checkpoint` (and `keras.remat` on torch) runs its function a second
time in the backward pass, and torch takes the gradients from that second run.
Its layers must be patched there exactly as they were in the forward pass, or the
gradients are silently those of another model. The recompute runs with none of
its callers around it, maybe on autograd's thread, maybe after the scope that
patched it closed, and maybe after other forward passes patched in other ways.

So each checkpointed forward pass run while patches are active notes, in call
order, what each wrapped layer call and each `cs.sow` inside it applied, under
torch's own object for that pass (`_keras_compat.torch_checkpoint`). Its
recompute replays the notes in the same order. Passes patched in different ways,
threads and retained graphs each replay their own, and a pass's notes go when
torch drops the pass. A checkpoint nested in a checkpointed function is made
again by the outer pass's recompute: the outer pass notes where it began, and the
new pass replays its notes. Where a recompute cannot be matched to its forward
pass, it raises rather than run with patches that may be another pass's.
"""

from __future__ import annotations

import threading
import weakref

from callscope import _keras_compat

_PASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # torch's pass -> _Notes
_REMADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pass -> replay id
_LOCK = threading.Lock()
_NESTED = ("nested",)  # `who` of a checkpoint nested in a checkpointed function
_UNNOTED = ("unnoted",)  # `_remade`: a pass made again whose forward pass noted nothing


class _Notes:
    """One checkpointed forward pass: (who, what it applied) per call, in order."""

    __slots__ = ("calls", "recompute", "next", "__weakref__")

    def __init__(self):
        self.calls: list[tuple] = []
        self.recompute = None  # the recompute replaying them now, and how far it is
        self.next = 0


def live() -> bool:
    """Are notes kept for a pass torch may still recompute?"""
    return bool(_PASSES)


def where(patched: bool, enclosing=None):
    """`(pass, recompute)` (see `_keras_compat.torch_checkpoint`) for a call now;
    None outside a checkpoint, or where nothing needs noting or replaying.
    `enclosing`: where a layer call around this one holds its own answer."""
    place = _keras_compat.torch_checkpoint(forward=patched, enclosing=enclosing)
    if place is None or place[1] is not None:
        return place
    if _keras_compat.in_torch_backward():
        return _remade(place[0])
    return place if patched else None


def note(place, who, applied) -> None:
    """In a checkpointed forward pass with patches active: `who` (a layer's call
    wrapper, or a sown name) applied `applied` (None: nothing)."""
    notes = _PASSES.get(place[0])
    if notes is None:
        notes = _begin(place[0])
    notes.calls.append((who, applied))


def replayed(place, who):
    """In a recompute: what `who`'s call applied at the same place in the forward
    pass (None: nothing, or the pass ran with no patches active)."""
    notes = _PASSES.get(place[0])
    if notes is None:
        return None
    recompute = (id(place[0]), place[1])
    if notes.recompute != recompute:  # (torch stops a recompute early when it can)
        notes.recompute, notes.next = recompute, 0
    if notes.next >= len(notes.calls) or notes.calls[notes.next][0] != who:
        raise RuntimeError(
            "A torch checkpoint's recompute in the backward pass called its layers "
            "in another order than its forward pass did, so callscope cannot apply "
            "each call's patches again. The checkpointed function must call the "
            "same layers in the same order each time, and open no `cs.patch` or "
            "`cs.capture` inside itself (open them around the checkpoint). Received: "
            f"call {notes.next + 1} of the recompute is {_named(who)}, where the "
            f"forward pass made {len(notes.calls)} calls"
            + (f", that one {_named(notes.calls[notes.next][0])}"
               if notes.next < len(notes.calls) else "")
        )
    applied = notes.calls[notes.next][1]
    notes.next += 1
    return applied


def _begin(checkpoint) -> _Notes:
    """The notes of a pass's first call. A pass nested in another checkpointed
    function is noted in the outer pass too, where it began: the outer pass's
    recompute makes it again (`_remade`)."""
    with _LOCK:
        notes = _PASSES.setdefault(checkpoint, _Notes())
    places = _keras_compat.torch_checkpoints_on_stack()
    if any(p[0] is checkpoint for p in places):  # (those after it enclose it)
        outer = next(places, None)
        if outer is not None and outer[1] is None:
            note(outer, _NESTED, notes)
    return notes


def _remade(checkpoint):
    """A checkpoint's forward pass inside a backward pass: one nested in a
    checkpointed function, made again by the outer pass's recompute (or by an
    outer pass made again itself). Its calls replay the notes of the pass it
    makes again, which the outer pass noted where it began; where there are none
    (no patches were active), they replay nothing, and record nothing again."""
    token = _REMADE.get(checkpoint)
    if token is None:
        token = _UNNOTED
        places = _keras_compat.torch_checkpoints_on_stack()
        if any(p[0] is checkpoint for p in places):  # (those after it enclose it)
            outer = next(places, None)
            if outer is not None and outer[1] is None:  # made again itself
                outer = _remade(outer[0])
            if outer is not None and outer[0] in _PASSES:
                notes = replayed(outer, _NESTED)
                with _LOCK:
                    _PASSES[checkpoint] = notes
                token = object()
        with _LOCK:
            _REMADE[checkpoint] = token
    return checkpoint, token


def sown(layer, name: str) -> tuple:
    """`who` for a `cs.sow` of `name` on `layer`."""
    return ("sow", layer.name, name, id(layer))


def _named(who) -> str:
    if who == _NESTED:
        return "a nested checkpoint"
    if isinstance(who, tuple):  # `sown(layer, name)`
        return f"cs.sow of {who[2]!r} on layer {who[1]!r}"
    return f"layer {who.layer.name!r}"
