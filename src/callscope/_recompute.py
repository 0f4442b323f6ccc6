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
torch drops the pass. Where a recompute cannot be matched to its forward pass, it
raises rather than run with patches that may be another pass's.
"""

from __future__ import annotations

import threading
import weakref

from callscope import _keras_compat

_PASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # torch's pass -> _Notes
_LOCK = threading.Lock()


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


def where(patched: bool):
    """`(pass, recompute)` (see `_keras_compat.torch_checkpoint`) for a call now;
    None outside a checkpoint, or where nothing needs noting or replaying."""
    place = _keras_compat.torch_checkpoint(forward=patched)
    if place is _keras_compat.HIDDEN:
        if not patched and not live():
            return None
        raise RuntimeError(
            "callscope cannot tell which torch checkpoint pass a patched layer runs "
            "in: a saved-tensors hook of another kind (e.g. "
            "`torch.autograd.graph.save_on_cpu`) is open inside the checkpointed "
            "function, so its recompute in the backward pass could not apply the "
            "patches of its own forward pass. Open that hook around the checkpoint "
            "instead, or patch the layer that makes the checkpoint."
        )
    if place is None or place[1] is not None:
        return place
    if _keras_compat.in_torch_backward() and live():
        raise RuntimeError(
            "callscope cannot replay patches in a torch checkpoint that runs inside "
            "another checkpoint's recompute (a checkpoint nested in a checkpointed "
            "function): the inner pass made there is a new one, and which forward "
            "pass it repeats cannot be told. Checkpoint at one level only, or patch "
            "the layer that makes the outer checkpoint."
        )
    return place if patched else None


def note(place, who, applied) -> None:
    """In a checkpointed forward pass with patches active: `who` (a layer's call
    wrapper, or a sown name) applied `applied` (None: nothing)."""
    notes = _PASSES.get(place[0])
    if notes is None:
        with _LOCK:
            notes = _PASSES.setdefault(place[0], _Notes())
    notes.calls.append((who, applied))


def replayed(place, who):
    """In a recompute: what `who`'s call applied at the same place in the forward
    pass (None: nothing, or the pass ran with no patches active)."""
    notes = _PASSES.get(place[0])
    if notes is None:
        return None
    if notes.recompute != place[1]:  # (torch stops a recompute early when it can)
        notes.recompute, notes.next = place[1], 0
    if notes.next >= len(notes.calls) or notes.calls[notes.next][0] != who:
        raise RuntimeError(
            "A torch checkpoint's recompute in the backward pass called its layers "
            "in another order than its forward pass did, so callscope cannot apply "
            "each call's patches again. The checkpointed function must call the "
            f"same layers in the same order each time. Received: call "
            f"{notes.next + 1} of the recompute is {_named(who)}, where the forward "
            f"pass made {len(notes.calls)} calls"
            + (f", that one {_named(notes.calls[notes.next][0])}"
               if notes.next < len(notes.calls) else "")
        )
    applied = notes.calls[notes.next][1]
    notes.next += 1
    return applied


def sown(layer, name: str) -> tuple:
    """`who` for a `cs.sow` of `name` on `layer`."""
    return ("sow", layer.name, name, id(layer))


def _named(who) -> str:
    if isinstance(who, tuple):  # `sown(layer, name)`
        return f"cs.sow of {who[2]!r} on layer {who[1]!r}"
    return f"layer {who.layer.name!r}"
