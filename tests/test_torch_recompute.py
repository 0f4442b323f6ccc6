"""torch runs a checkpoint's function again in the backward pass (the recompute)
and takes the gradients from there: each recompute must apply exactly the patches
its own forward pass applied, whatever ran in between. The reference is the same
model without the checkpoint, same weights and patches, same passes: autograd's
own gradients, which never recompute anything."""

import contextlib
import gc
import threading

import keras
import numpy as np
import pytest
from conftest import BACKEND

import callscope as cs

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="torch's checkpoint recomputes")

if BACKEND == "torch":
    import torch
    from torch.utils.checkpoint import checkpoint

    from callscope import _recompute

rng = np.random.default_rng(0)
X = rng.normal(size=(6, 3)).astype("float32")
Y = rng.normal(size=(6, 1)).astype("float32")
TRIPLE = {"c/inner/d1": lambda v: v * 3.0 + 1.0}
NEGATE = {"c/inner/d1/twice": lambda v: -v, "c/inner/mid": lambda v: keras.ops.tanh(v) - 2.0}


class Inner(keras.layers.Layer):
    """d1 then d2, inside a torch checkpoint (`how`: None, "reentrant" or
    "non_reentrant"); the body sows on d1 and on this layer itself."""

    def __init__(self, how=None, **kwargs):
        super().__init__(**kwargs)
        self.how = how
        self.d1 = keras.layers.Dense(4, name="d1")
        self.d2 = keras.layers.Dense(4, name="d2")

    def build(self, input_shape):  # (a reentrant checkpoint cannot run symbolically)
        self.d1.build(input_shape)
        self.d2.build((None, 4))

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], 4)

    def body(self, t):
        h = self.d1(t)
        h = h + cs.sow(self.d1, "twice", h * 2.0)
        return cs.sow(self, "mid", self.d2(h))

    def call(self, x):
        if self.how is None:
            return self.body(x)
        if self.how == "reentrant":  # (its gradients flow only from inputs that need them)
            return checkpoint(lambda t, _: self.body(t), x, self.d1.kernel.value,
                              use_reentrant=True)
        return checkpoint(self.body, x, use_reentrant=False)


def _model(how, layer=Inner):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = layer(how, name="inner")(inputs)
    return cs.Model(inputs, keras.layers.Dense(1, name="head")(h), name="c")


def _loss(model, patches):
    with cs.patch(model, patches) if patches else contextlib.nullcontext():
        out = model(torch.as_tensor(X))
    return ((out - torch.as_tensor(Y)) ** 2).mean()


def _grads(model, loss, **kwargs):
    weights = [w.value for w in model.trainable_weights]
    inner = model.get_layer("inner")
    if "reentrant" in (inner.how, getattr(inner, "inner", None)):  # (no autograd.grad there)
        for w in weights:
            w.grad = None
        loss.backward(**kwargs)
        return [w.grad.numpy().copy() for w in weights]
    return [g.numpy() for g in torch.autograd.grad(loss, weights, **kwargs)]


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.concatenate([w.ravel() for w in want])).all()
    assert max(np.abs(w).max() for w in want) > 1e-3


HOWS = ["non_reentrant", "reentrant"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("order", [(TRIPLE, None), (None, TRIPLE), (TRIPLE, NEGATE),
                                   (NEGATE, TRIPLE, None)])
def test_passes_patched_in_different_ways_before_one_backward(how, order):
    """Each pass's recompute takes its own patches (before, each took the last
    pass's: a patched then a clean pass gave gradients off by up to 107)."""
    got = _grads(m := _model(how), sum(_loss(m, p) for p in order))
    want = _grads(r := _model(None), sum(_loss(r, p) for p in order))
    _same(got, want)
    del m, r
    gc.collect()
    assert not _recompute.live()  # the notes go with torch's passes


def test_a_graph_kept_across_other_passes_recomputes_with_its_own_patches():
    model, reference = _model("non_reentrant"), _model(None)
    for m in (model, reference):
        first = _loss(m, TRIPLE)
        _grads(m, first, retain_graph=True)
        _grads(m, _loss(m, NEGATE))
        m.again = _grads(m, first)
    _same(model.again, reference.again)


def test_two_threads_each_recompute_their_own_patches():
    model, reference = _model("non_reentrant"), _model(None)
    want = [_grads(reference, _loss(reference, p)) for p in (TRIPLE, NEGATE)]
    got, errors = [None, None], []
    barrier = threading.Barrier(2)

    def run(i, patches):
        try:
            loss = _loss(model, patches)
            barrier.wait()  # both forward passes before either backward pass
            got[i] = _grads(model, loss)
        except Exception as e:  # noqa: BLE001 (raised again below)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in
               enumerate((TRIPLE, NEGATE))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for g, w in zip(got, want):
        _same(g, w)


def test_gradient_accumulation_under_patches_reopened_with_new_equal_functions():
    def passes(m):
        return sum(_loss(m, {"c/inner/d1": lambda v: v * 3.0}) for _ in range(3))

    _same(_grads(m := _model("non_reentrant"), passes(m)), _grads(r := _model(None), passes(r)))


def test_a_patched_look_then_training_without_patches():
    """A patched call that is never differentiated leaves nothing that matters."""
    model, reference = _model("non_reentrant"), _model(None)
    for m in (model, reference):
        with cs.patch(m, TRIPLE):
            m(torch.as_tensor(X))
        m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        m.fit(X, Y, batch_size=3, epochs=2, shuffle=False, verbose=0)
    _same(model.get_weights(),
          reference.get_weights())


class Shared(keras.layers.Layer):
    """One Dense reached from two blocks, each checkpointing its own body: two
    points of one layer, patched at one of them only."""

    def __init__(self, how=None, **kwargs):
        super().__init__(**kwargs)
        self.how = how
        self.shared = keras.layers.Dense(3, name="shared")
        self.a = Block(self.shared, how, name="a")
        self.b = Block(self.shared, how, name="b")
        self.d1 = keras.layers.Dense(4, name="d1")  # (for TRIPLE)

    def call(self, x):
        return self.d1(self.b(self.a(x)))


class Block(keras.layers.Layer):
    def __init__(self, shared, how, **kwargs):
        super().__init__(**kwargs)
        self.shared, self.how = shared, how
        self.own = keras.layers.Dense(3, name="own")

    def call(self, x):
        body = lambda t: self.own(self.shared(t))  # noqa: E731
        return body(x) if self.how is None else checkpoint(body, x, use_reentrant=False)


def test_a_shared_layer_in_two_checkpoints_patched_at_one_point():
    patches = {"c/inner/a/shared": lambda v: v * -4.0}
    got = _grads(m := _model("non_reentrant", Shared), _loss(m, patches))
    want = _grads(r := _model(None, Shared), _loss(r, patches))
    _same(got, want)


class Keyed(keras.layers.Layer):
    """Inside the checkpoint, a layer returns a dict whose key "d1" is its sublayer
    `d1`'s name, with another value: the points `.../keyed/d1` and `.../keyed/d1#1`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(4, name="d1")

    def call(self, x):
        h = self.d1(x)
        return {"d1": h * 2.0, "h": h}


class KeyedInner(Inner):
    def __init__(self, how=None, **kwargs):
        super().__init__(how, **kwargs)
        self.keyed = Keyed(name="keyed")

    def build(self, input_shape):
        super().build(input_shape)
        self.keyed.build((None, 4))

    def body(self, t):
        return self.d2(self.keyed(self.d1(t))["d1"])


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("point", ["c/inner/keyed/d1", "c/inner/keyed/d1#1"])
def test_a_recompute_patches_an_element_named_as_a_sublayer_once(how, point):
    patches = {point: lambda v: v * 3.0 + 1.0}
    got = _grads(m := _model(how, KeyedInner), _loss(m, patches))
    want = _grads(r := _model(None, KeyedInner), _loss(r, patches))
    _same(got, want)


def test_fit_under_a_patch_on_a_reentrant_checkpoint():
    weights = {}
    for how in (None, "reentrant"):
        model = _model(how)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        with cs.patch(model, {**TRIPLE, **NEGATE}):
            model.fit(X, Y, batch_size=3, epochs=2, shuffle=False, verbose=0)
        model.fit(X, Y, batch_size=3, epochs=1, shuffle=False, verbose=0)  # and after it
        weights[how] = model.get_weights()
    _same(weights["reentrant"], weights[None])


@pytest.mark.parametrize("how", HOWS)
def test_a_patched_predict_through_a_checkpoint(how):
    outputs = []
    for h in (None, how):
        model = _model(h)
        with cs.patch(model, {**TRIPLE, **NEGATE}):
            outputs.append(model.predict(X, verbose=0))
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-6)


class Hiding(Inner):
    """Opens a saved-tensors hook of another kind inside the checkpointed function,
    above torch's own: the checkpoint is then found on the Python stack."""

    def body(self, t):
        with torch.autograd.graph.save_on_cpu():
            return super().body(t)


@pytest.mark.parametrize("layer", [Inner, Hiding])
def test_save_on_cpu_around_the_checkpoint_or_inside_it(layer):
    patches = {**TRIPLE, **NEGATE}
    model, reference = _model("non_reentrant", layer), _model(None, layer)
    with torch.autograd.graph.save_on_cpu():
        got = _grads(model, _loss(model, patches) + _loss(model, None))
    _same(got, _grads(reference, _loss(reference, patches) + _loss(reference, None)))


class Nested(Inner):
    """A checkpoint (`inner`: reentrant or not) inside the checkpointed function,
    and (`after`) a layer after it, so that the outer recompute makes it again."""

    inner, after = "non_reentrant", False

    def body(self, t):
        if self.inner == "reentrant":
            h = checkpoint(lambda u, _: super(Nested, self).body(u), t, self.d2.kernel.value,
                           use_reentrant=True)
        else:
            h = checkpoint(super().body, t, use_reentrant=False)
        return self.d2(h) if self.after else h


@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("outer", HOWS)
@pytest.mark.parametrize("inner", HOWS)
def test_a_checkpoint_nested_in_a_checkpoint(outer, inner, after, monkeypatch):
    """Each level's recompute applies its own forward pass's patches. Where the
    outer recompute makes the inner checkpoint again (a layer after it needs
    that), the new inner pass replays the notes of the one it makes again."""
    monkeypatch.setattr(Nested, "inner", inner)
    monkeypatch.setattr(Nested, "after", after)
    patches = {**TRIPLE, **NEGATE}
    model, reference = _model(outer, Nested), _model(None, Nested)
    _same(_grads(model, _loss(model, patches) + _loss(model, None)),
          _grads(reference, _loss(reference, patches) + _loss(reference, None)))
    # Without patches it runs as torch's, while another model's patched pass
    # waits for its backward pass.
    other = _model("non_reentrant")
    waiting = _loss(other, TRIPLE)
    _same(_grads(model, _loss(model, None)), _grads(reference, _loss(reference, None)))
    _same(_grads(other, waiting), _grads(r := _model(None), _loss(r, TRIPLE)))


class Deeper(Nested):
    """Three levels: this body checkpoints Nested's, which checkpoints Inner's."""

    def body(self, t):
        return self.d2(checkpoint(super().body, t, use_reentrant=False))


@pytest.mark.parametrize("inner", HOWS)
def test_three_levels_of_checkpoints(inner, monkeypatch):
    monkeypatch.setattr(Nested, "inner", inner)
    for after in (False, True):
        monkeypatch.setattr(Nested, "after", after)
        for patches in ({**TRIPLE, **NEGATE}, {"c/inner/d2": lambda v: v * -2.0}):
            model, reference = _model("non_reentrant", Deeper), _model(None, Deeper)
            _same(_grads(model, _loss(model, patches) + _loss(model, None)),
                  _grads(reference, _loss(reference, patches) + _loss(reference, None)))


def _fit_captured(hows, layer=Inner, patches=None, kinds=("output", "grad")):
    """A capture of every point in one `fit` epoch, per way to checkpoint."""
    caps = []
    for how in hows:
        model = _model(how, layer)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        patching = cs.patch(model, patches) if patches else contextlib.nullcontext()
        with patching, cs.capture(model, "*", kinds=kinds) as cap:
            model.fit(X, Y, batch_size=3, epochs=1, shuffle=False, verbose=0)
        caps.append(cap)
    return caps


def _same_captures(got, want):
    assert sorted(got.keys()) == sorted(want.keys())
    for key in want.keys():
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]),
                                   rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("patches", [None, TRIPLE])
def test_captures_through_nested_checkpoints_are_those_without_them(patches):
    """A pass made again by an outer recompute records nothing again."""
    _same_captures(*_fit_captured(("non_reentrant", None), Deeper, patches))


class Flipping(Inner):
    """Calls its layers in another order each time: a recompute cannot repeat it."""

    calls = 0

    def body(self, t):
        Flipping.calls += 1
        if Flipping.calls % 2:
            return self.d2(self.d1(t))
        return self.d2(self.d1(t) * 0.0 + self.d1(t))


def test_a_recompute_that_calls_other_layers_raises():
    model = _model("non_reentrant", Flipping)
    with pytest.raises(RuntimeError, match=r"called its layers in another order than its "
                       r"forward pass did.*Received: call 2 of the recompute is layer 'd1'"):
        _grads(model, _loss(model, TRIPLE))


def test_gradients_inside_a_reentrant_checkpoint_are_refused_and_right_elsewhere():
    """A reentrant checkpoint runs its forward pass without gradients: d loss / d a
    point inside reads 0 there, so it raises; its outputs are captured right."""
    model = _model("reentrant")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    with pytest.raises(cs.LoopPointError, match=r"d loss / d `c/inner/d1` cannot be taken: "
                       r"the point runs inside a reentrant torch checkpoint .*"
                       r"use_reentrant=False"):
        with cs.capture(model, "*", kinds=("grad",)):
            model.fit(X, Y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    _same_captures(*_fit_captured(("non_reentrant", None)))
    _same_captures(*_fit_captured(("reentrant", None), kinds=("output",)))
