"""Points users can name: stable names from the call tree, every output and input,
layers in loops, quantized layers, patches across batches, sown names."""

import warnings

import numpy as np
import pytest
import keras
from keras import layers, ops

import callscope as cs
from conftest import BACKEND, numpy

X = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")


# --------------------------------------------------------------------------
# Names come from the call tree, whatever the build history
# --------------------------------------------------------------------------
def _seq():
    return cs.Sequential([keras.Input((4,)), layers.Dense(5, name="hidden"),
                          layers.ReLU(name="act"), layers.Dense(2, name="out")], name="seq")


def test_names_do_not_depend_on_build_history_or_loading(tmp_path):
    fresh = _seq()
    hidden = layers.Dense(5, name="hidden")
    hidden(X)  # called once before it joins a model: Keras gives it the path "hidden"
    early = cs.Sequential([keras.Input((4,)), hidden, layers.ReLU(name="act"),
                           layers.Dense(2, name="out")], name="seq")
    fresh.save(tmp_path / "m.keras")
    loaded = cs.enable(keras.saving.load_model(tmp_path / "m.keras"))
    expected = {"seq": (8, 2), "seq/hidden": (8, 5), "seq/act": (8, 5), "seq/out": (8, 2)}
    for model in (fresh, early, loaded):
        assert cs.points(model, X) == expected
    with cs.capture(loaded, "*") as cap:
        out = loaded.predict(X, verbose=0)
    assert sorted(cap) == sorted(f"{p}:output" for p in expected)
    np.testing.assert_allclose(cap["seq:output"], out)


def test_functional_points_are_prefixed_by_the_model():
    inputs = keras.Input((4,))
    h = layers.Dense(3, name="d")(inputs)
    model = cs.Model(inputs, layers.Dropout(0.5, name="drop")(h), name="func")
    assert cs.points(model, X) == {"func": (8, 3), "func/d": (8, 3), "func/drop": (8, 3)}


class Block(layers.Layer):
    """A block with weightless layers (Keras gives them no path of their own)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")
        self.act = layers.ReLU(name="act")
        self.drop = layers.Dropout(0.5, name="drop")

    def call(self, x, training=None):
        return self.drop(self.act(self.dense(x)), training=training)


class TwoBlocks(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = Block(name="block_a")
        self.second = Block(name="block_b")

    def call(self, x, training=None):
        return self.second(self.first(x, training=training), training=training)


def test_weightless_layers_of_two_blocks_are_two_points_and_patch_one():
    model = TwoBlocks(name="net")
    points = cs.points(model, X)
    assert {"net/block_a/act", "net/block_b/act", "net/block_a/drop",
            "net/block_b/drop"} <= set(points)
    assert not any("@" in p for p in points)
    with cs.capture(model, "net/block_*") as before:
        model.predict(X, verbose=0)
    with cs.capture(model, "net/block_*") as after, \
            cs.patch(model, {"net/block_b/act": keras.ops.zeros_like}):
        out = model.predict(X, verbose=0)
    for key in ("net/block_a:output", "net/block_a/act:output", "net/block_b/dense:output"):
        np.testing.assert_array_equal(after[key], before[key])
    np.testing.assert_array_equal(after["net/block_b/act:output"], 0.0)
    np.testing.assert_array_equal(out, 0.0)
    assert np.abs(before["net/block_b/act:output"]).sum() > 0
    # The glob of one block reaches its weightless layers too.
    with cs.capture(model, "net/block_a/*") as cap:
        model.predict(X, verbose=0)
    assert sorted(cap) == ["net/block_a/act:output", "net/block_a/dense:output",
                           "net/block_a/drop:output"]


def test_two_instances_with_one_name_are_two_points():
    class Twins(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.a = layers.Dense(3, name="twin")
            self.b = layers.Dense(3, name="twin")

        def call(self, x):
            return self.b(self.a(x))

    model = Twins(name="twins")
    assert set(cs.points(model, X)) == {"twins", "twins/twin", "twins/twin#1"}
    with cs.capture(model, "twins/twin*") as cap:
        model.predict(X, verbose=0)
    w = [numpy(v) for v in model.a.weights]
    np.testing.assert_allclose(cap["twins/twin:output"], X @ w[0] + w[1], rtol=1e-5, atol=1e-6)


def test_two_instances_with_one_name_keep_their_points_whichever_runs_first():
    # Which twin is `#1` is where the model holds it, not which ran first: by run
    # order, a call that ran them the other way round joined b's rows to a's under
    # one key, and a patch of `flip/twin` hit b there, silently.
    class Flip(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.a = layers.Dense(3, name="twin", kernel_initializer="ones")
            self.b = layers.Dense(3, name="twin", kernel_initializer="zeros",
                                  bias_initializer="ones")
            self.register_context_args("flip")

        def call(self, x, flip=False):
            return self.a(self.b(x)) if flip else self.b(self.a(x))

    model = Flip(name="flip")
    x = np.arange(12, dtype="float32").reshape(4, 3)  # (twins map 3 features to 3)
    a_of_x, a_of_ones = x.sum(1, keepdims=True) * np.ones(3), np.full((4, 3), 3.0)
    with cs.capture(model, "flip/twin*") as cap:
        model.predict(x, verbose=0)
        model.predict(x, flip=True, verbose=0)
    np.testing.assert_allclose(cap["flip/twin:output"], np.concatenate([a_of_x, a_of_ones]))
    np.testing.assert_allclose(cap["flip/twin#1:output"], np.ones((8, 3)))
    with cs.context(flip=True):
        assert list(cs.points(model, x)) == list(cs.points(model, x[:, ::-1]))
    with cs.patch(model, {"flip/twin": lambda h: h * 0 + 7.0}):  # a, in both orders
        np.testing.assert_allclose(model.predict(x, verbose=0), np.ones((4, 3)))
        np.testing.assert_allclose(model.predict(x, flip=True, verbose=0), np.full((4, 3), 7.0))


@pytest.mark.parametrize("change", ["pop", "del"])
def test_sublayers_changed_between_calls_are_keyed_as_cs_points_keys_them(change):
    # torch runs a step's Python every step: its key kept the numbering of the
    # first step's sublayers, so after `pop(0)` the layer `cs.points` calls
    # `net/d` was captured as `net/d#1` and a patch of `net/d` hit another layer;
    # after `del net.a` (Keras still tracks `a`, but no attribute holds it now)
    # `b` stayed `net/d#1`.
    class Net(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.a = _bias(1.0, name="d")
            self.ds = [_bias(k, name="d") for k in (2.0, 3.0)]

        def call(self, x):
            x = self.a(x) if hasattr(self, "a") else x
            for dense in self.ds:
                x = dense(x)
            return x

    net = Net(name="net")
    x = np.ones((4, 2), "float32")
    net.compile(optimizer="sgd", loss="mse")
    last = {"net/d#1": lambda h: h * 0.0}  # the last layer after the change
    with cs.capture(net, "net/d*"):
        net.predict(x, verbose=0)
    with cs.patch(net, {"net/d#2": lambda h: h * 0.0}):
        net.predict(x, verbose=0)
    if change == "pop":
        net.ds.pop(0)  # net/d is a (bias 1), then 3 at net/d#1
        biases = {"net/d": 1.0, "net/d#1": 3.0}
    else:
        del net.a  # net/d is the first of ds (bias 2), then 3
        biases = {"net/d": 2.0, "net/d#1": 3.0}
    if BACKEND != "torch":
        # (Keras's compiled functions keep the layers they traced: README, "Limits".)
        net.compile(optimizer="sgd", loss="mse")
    assert [p for p in cs.points(net, x) if p.startswith("net/d")] == list(biases)
    with cs.capture(net, "net/d*") as cap:
        net.predict(x, verbose=0)
    assert sorted(cap) == sorted(f"{p}:output" for p in biases)
    for point, bias in biases.items():
        np.testing.assert_array_equal(cap[f"{point}:output"], np.full((4, 2), bias))
    with cs.patch(net, last):
        np.testing.assert_array_equal(net.predict(x, verbose=0), np.zeros((4, 2)))


def test_sublayers_changed_by_a_callback_within_a_call_are_keyed_anew_from_the_next_step():
    # An eager step (torch's; `run_eagerly`) runs its Python every step: a layer
    # popped by a callback between two batches of one predict left the rest of
    # the call numbered as before (the last layer's rows under `net/d#2`, which
    # `cs.points` no longer lists, and a patch of `net/d#1` reached nothing).
    class Net(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.ds = [_bias(k, name="d") for k in (1.0, 10.0, 100.0)]

        def call(self, x):
            for dense in self.ds:
                x = dense(x)
            return x

    class PopAfterFirstBatch(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            if batch == 0:
                self.model.ds.pop(0)

    net = Net(name="net")
    net.compile(loss="mse", run_eagerly=True)
    x = np.ones((8, 2), "float32")
    net.predict(x, batch_size=4, verbose=0)
    with cs.capture(net, "net/d*") as cap:
        net.predict(x, batch_size=4, verbose=0, callbacks=[PopAfterFirstBatch()])
    assert sorted(cap) == ["net/d#1:output", "net/d#2:output", "net/d:output"]
    np.testing.assert_array_equal(cap["net/d:output"][:, 0], [1] * 4 + [10] * 4)
    np.testing.assert_array_equal(cap["net/d#1:output"][:, 0], [10] * 4 + [100] * 4)
    with pytest.raises(ValueError, match=r"recorded by 1 of the 2 steps .* steps \[1\]"):
        cap["net/d#2:output"]  # (its 4 rows would not line up with the 8 of the data)


def _bias(k, **kwargs):
    return layers.Dense(2, kernel_initializer="zeros",
                        bias_initializer=keras.initializers.Constant(k), **kwargs)


class _Holds(layers.Layer):
    def __init__(self, k, **kwargs):
        super().__init__(**kwargs)
        self.d = _bias(k, name="d")

    def call(self, x):
        return self.d(x)


@cs.context_args("flip")
class _CallsTwo(layers.Layer):
    def __init__(self, a, b, names=None, **kwargs):
        super().__init__(**kwargs)
        if names is None:  # it calls them, but does not hold them
            self.both = lambda: (a, b)
        else:
            setattr(self, names[0], a)
            setattr(self, names[1], b)
            self.both = lambda: (getattr(self, names[0]), getattr(self, names[1]))

    def call(self, x, flip=False):
        a, b = self.both()
        return b(x) + 10.0 * a(x) if flip else 10.0 * a(x) + b(x)


@pytest.mark.parametrize("case", ["held_by_two", "called_by_a_non_holder"])
def test_layers_named_alike_keep_their_points_whichever_runs_first(case):
    # Both cases followed run order: a layer held by two parents took its first
    # holder's attribute name under the second (`proj`, beside that one's own
    # `proj`), and two `d`s held by two blocks and called by a third shared one n.
    class Flip(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            if case == "held_by_two":
                self.first = _Holds(0.0)
                self.first.proj = _bias(1.0)  # unnamed: its point is its attribute's,
                self.pair = _CallsTwo(self.first.proj, _bias(2.0),  # `head` here, beside
                                      names=("head", "proj"), name="pair")  # its own `proj`
            else:
                self.h1, self.h2 = _Holds(1.0, name="h1"), _Holds(2.0, name="h2")
                self.pair = _CallsTwo(self.h1.d, self.h2.d, name="pair")
            self.register_context_args("flip")

        def call(self, x):
            return self.pair(x)

    model = Flip(name="f")
    x = np.ones((2, 2), "float32")
    one, two = ("f/pair/head", "f/pair/proj") if case == "held_by_two" else (
        "f/pair/d", "f/pair/d#1")
    with cs.capture(model, [one, two]) as cap:
        model.predict(x, verbose=0)
        model.predict(x, flip=True, verbose=0)
    np.testing.assert_array_equal(cap[f"{one}:output"], np.full((4, 2), 1.0))
    np.testing.assert_array_equal(cap[f"{two}:output"], np.full((4, 2), 2.0))
    with cs.patch(model, {one: keras.ops.zeros_like}):  # the bias-1 layer, in both orders
        for flip in (False, True):
            np.testing.assert_array_equal(model.predict(x, flip=flip, verbose=0), 2.0)


def test_a_layer_its_caller_does_not_hold_comes_after_those_it_holds_in_every_order():
    # A block's `d` and a `d` passed in from outside, both called by `p`: ranked in
    # two trees, both took 0 and run order broke the tie; and beside a held `d`,
    # the block's one was `#2` (the held one counted twice).
    @cs.context_args("flip")
    class P(layers.Layer):
        def __init__(self, outside, **kwargs):
            super().__init__(**kwargs)
            self.inner = _Holds(1.0, name="inner")
            self.outside = lambda: outside  # called here, held by the model

        def call(self, x, flip=False):
            a, b = self.inner.d, self.outside()
            return b(x) + 10.0 * a(x) if flip else 10.0 * a(x) + b(x)

    class M(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d = _bias(2.0, name="d")
            self.p = P(self.d, name="p")
            self.register_context_args("flip")

        def call(self, x):
            return self.p(x) + self.d(x) + self.p.inner.d(x)

    model = M(name="m")
    x = np.ones((2, 2), "float32")
    with cs.capture(model, ["m/p/d*", "m/d*"]) as cap:
        model.predict(x, verbose=0)
        model.predict(x, flip=True, verbose=0)
    assert {k: float(v[0, 0]) for k, v in cap.items()} == {
        "m/p/d:output": 1.0, "m/p/d#1:output": 2.0, "m/d:output": 2.0, "m/d#1:output": 1.0}
    for key in cap:
        assert np.unique(cap[key]).size == 1, key


def test_an_inner_models_scope_keys_layers_it_does_not_hold_alike_through_the_outer():
    # Ranked over the outer model's tree (whose order Keras turns round below its
    # first level), `enc/d#1` was another layer when the outer model called `enc`.
    class Enc(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.blocks = [_Holds(k, name=n) for k, n in ((1.0, "a"), (2.0, "b"), (3.0, "c"))]

        def call(self, x):  # its blocks' layers, called directly
            return sum(10.0 ** i * block.d(x) for i, block in enumerate(self.blocks))

    class Outer(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.other = _Holds(5.0, name="other")
            self.enc = Enc(name="enc")

        def call(self, x):
            return self.enc(x) + self.other(x)

    outer = Outer(name="outer")
    x = np.ones((2, 2), "float32")
    outer(x)
    for call in (outer.enc, outer):
        with cs.capture(outer.enc, "enc/d*") as cap:
            call(x)
        assert {k: float(v[0, 0]) for k, v in cap.items()} == {
            "enc/d:output": 1.0, "enc/d#1:output": 2.0, "enc/d#2:output": 3.0}
        with cs.patch(outer.enc, {"enc/d#1": keras.ops.zeros_like}):  # b's, both ways
            np.testing.assert_array_equal(numpy(outer.enc(x)), 301.0)
            np.testing.assert_array_equal(numpy(outer(x)), 306.0)


def test_inner_model_scopes_name_points_from_the_inner_model():
    inner = cs.Sequential([keras.Input((4,)), layers.Dense(3, name="d")], name="enc")
    outer = cs.Sequential([keras.Input((4,)), inner, layers.Dense(2, name="head")],
                          name="ae")
    assert "ae/enc/d" in cs.points(outer, X)
    with cs.capture(inner, "enc/d") as cap, cs.capture(outer, "ae/enc/d") as whole:
        outer.predict(X, verbose=0)
    np.testing.assert_array_equal(cap["enc/d:output"], whole["ae/enc/d:output"])
    with cs.patch(inner, {"enc/d": keras.ops.zeros_like}):
        out = outer.predict(X, verbose=0)
    np.testing.assert_allclose(out, np.broadcast_to(numpy(outer.layers[-1].bias), out.shape))


# --------------------------------------------------------------------------
# Every output and input
# --------------------------------------------------------------------------
class Pair(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = layers.Dense(3, name="d1")
        self.d2 = layers.Dense(3, name="d2")

    def call(self, x):
        return self.d1(x), self.d2(x)


class PairNet(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pair = Pair(name="pair")

    def call(self, x):
        a, b = self.pair(x)
        return 2.0 * a + 3.0 * b


def test_tuple_output_selected_by_its_layer_and_each_element_has_its_gradient():
    model = PairNet(name="net")
    model.compile(optimizer="sgd", loss="mse")
    y = np.zeros((8, 3), "float32")
    with cs.capture(model, "net/pair", kinds=("output", "grad")) as cap:
        model.evaluate(X, y, batch_size=8, verbose=0)
    assert sorted(cap) == ["net/pair/0:grad", "net/pair/0:output", "net/pair/1:grad",
                           "net/pair/1:output"]
    out = 2.0 * cap["net/pair/0:output"] + 3.0 * cap["net/pair/1:output"]
    d_out = 2.0 * (out - y) / out.size  # d mse / d y_pred
    np.testing.assert_allclose(cap["net/pair/0:grad"], 2.0 * d_out, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(cap["net/pair/1:grad"], 3.0 * d_out, rtol=1e-5, atol=1e-7)
    assert np.abs(cap["net/pair/0:grad"]).sum() > 0


def test_patch_one_element_of_a_tuple_output():
    model = PairNet(name="net")
    with cs.capture(model, "net/pair") as cap:
        plain = model.predict(X, verbose=0)
    with cs.patch(model, {"net/pair/1": keras.ops.zeros_like}):
        patched = model.predict(X, verbose=0)
    np.testing.assert_allclose(patched, 2.0 * cap["net/pair/0:output"], rtol=1e-6)
    assert not np.allclose(plain, patched)


def test_an_output_element_named_as_a_sublayer_is_a_point_of_its_own():
    # Keras's own idiom, a Functional's dict output keyed by its output layers' names:
    # `m/o1` (the Dense) and the model's element "o1" were one point, read as `@0` and
    # `@1`, and a patch of `m/o1` ran on both (+2).
    inputs = keras.Input((4,), name="x")
    h = layers.Dense(3, name="h")(inputs)
    model = cs.Model(inputs, {"o1": layers.Dense(2, name="o1")(h),
                              "o2": layers.Dense(1, name="o2")(h)}, name="m")
    assert {"m/o1", "m/o1#1", "m/o2", "m/o2#1"} <= set(cs.points(model, X))
    plain = model.predict(X, verbose=0)
    for point in ("m/o1", "m/o1#1"):
        with cs.patch(model, {point: lambda v: v + 1.0}):
            patched = model.predict(X, batch_size=3, verbose=0)
        np.testing.assert_allclose(patched["o1"] - plain["o1"], 1.0, rtol=1e-5)
        np.testing.assert_allclose(patched["o2"], plain["o2"], rtol=1e-6)
    model.compile(optimizer="sgd", loss={"o1": "mse", "o2": "mse"})
    y = {"o1": np.zeros((8, 2), "float32"), "o2": np.zeros((8, 1), "float32")}
    with cs.capture(model, "m/o1", kinds=("output", "grad")) as cap:
        model.evaluate(X, y, batch_size=8, verbose=0)
    assert sorted(cap) == ["m/o1:grad", "m/o1:output"]
    np.testing.assert_allclose(cap["m/o1:output"], plain["o1"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap["m/o1:grad"], 2.0 * plain["o1"] / plain["o1"].size,
                               rtol=1e-4, atol=1e-7)

    # A subclassed layer's dict element under its sublayer's name, another value.
    class Block(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.proj = layers.Dense(3, name="proj")

        def call(self, x):
            p = self.proj(x)
            return {"proj": p * 2.0, "x": x}

    class Net(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = Block(name="block")

        def call(self, x):
            return self.block(x)["proj"]

    net = Net(name="net")
    net(X)
    w = [numpy(v) for v in net.block.proj.weights]
    p = X @ w[0] + w[1]
    with cs.capture(net, ["net/block/proj", "net/block/proj#1"]) as cap:
        net.predict(X, verbose=0)
    assert sorted(cap) == ["net/block/proj#1:output", "net/block/proj:output"]
    np.testing.assert_allclose(cap["net/block/proj:output"], p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap["net/block/proj#1:output"], 2 * p, rtol=1e-5, atol=1e-6)
    for point, want in (("net/block/proj", 2 * (p + 1)), ("net/block/proj#1", 2 * p + 1)):
        with cs.patch(net, {point: lambda v: v + 1.0}):
            np.testing.assert_allclose(net.predict(X, verbose=0), want, rtol=1e-5, atol=1e-5)


def test_names_and_keys_holding_the_characters_of_keys_are_percent_encoded(tmp_path):
    # An output `{"d1@1": ...}` beside a shared `d1` called twice was the key of
    # d1's second run, which was lost; `{"a/b": ...}` read as the layer b of a.
    # Layer names may hold `@ : # * ?` too (Keras refuses only `/`; TF's name
    # scopes refuse them all, so there the odd layer is named plainly).
    odd_name = "odd:1@2#3*?%" if BACKEND != "tensorflow" else "odd.1"
    odd_point = "m/odd%3A1%402%233%2A%3F%25" if BACKEND != "tensorflow" else "m/odd.1"
    inputs = keras.Input((4,), name="x")
    d1 = layers.Dense(2, name="d1")
    first, second = d1(inputs), d1(layers.Dense(4, name="pre")(inputs))
    odd = layers.Dense(3, name=odd_name)(inputs)
    model = cs.Model(inputs, {"d1@1": layers.Dense(2, name="other")(inputs),
                              "a/b": layers.Add(name="add")([first, second]), "odd": odd},
                     name="m")
    points = set(cs.points(model, X))
    assert {"m/d1@0", "m/d1@1", "m/d1%401", "m/a%2Fb", odd_point} <= points
    with cs.capture(model, "*") as cap:
        plain = model.predict(X, verbose=0)
    np.testing.assert_allclose(cap["m/d1%401:output"], plain["d1@1"], rtol=1e-6)
    np.testing.assert_allclose(cap["m/a%2Fb:output"], plain["a/b"], rtol=1e-6)
    np.testing.assert_allclose(cap["m/d1@0:output"] + cap["m/d1@1:output"], plain["a/b"],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap[f"{odd_point}:output"], plain["odd"], rtol=1e-6)
    pre = keras.Model(inputs, model.get_layer("pre").output)  # stock sub-model
    w, b = (numpy(v) for v in d1.weights)
    np.testing.assert_allclose(cap["m/d1@1:output"], pre.predict(X, verbose=0) @ w + b,
                               rtol=1e-5, atol=1e-6)
    # The same names after loading; a glob and a patch take the name as keys write it.
    model.save(tmp_path / "m.keras")
    loaded = cs.enable(keras.saving.load_model(tmp_path / "m.keras"))
    assert set(cs.points(loaded, X)) == points
    with cs.patch(loaded, {"m/d1%401": lambda v: v + 1.0}), \
            cs.capture(loaded, "m/odd[%.]*") as cap:
        patched = loaded.predict(X, verbose=0)
    np.testing.assert_allclose(patched["d1@1"], plain["d1@1"] + 1.0, rtol=1e-5)
    np.testing.assert_allclose(patched["a/b"], plain["a/b"], rtol=1e-6)
    assert sorted(cap) == [f"{odd_point}:output"]

    # Layers with names Keras made up, held in a dict: named by its keys.
    class Heads(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.heads = {"x/y": layers.Dense(2), "d": layers.Dense(3), "d@1": layers.Dense(2)}

        def call(self, x):
            d = self.heads["d"]
            return d(x[:, :3]), d(x[:, 1:]), self.heads["d@1"](x), self.heads["x/y"](x)

    net = Heads(name="net")
    with cs.capture(net, "*") as cap:
        outputs = [numpy(o) for o in net(X)]
    assert {"net/heads_d@0", "net/heads_d@1", "net/heads_d%401", "net/heads_x%2Fy"} <= set(
        cs.points(net, X))
    for key, want in zip(("net/heads_d@0", "net/heads_d@1", "net/heads_d%401",
                          "net/heads_x%2Fy"), outputs):
        np.testing.assert_allclose(cap[f"{key}:output"], want, rtol=1e-6)


def test_an_elements_name_does_not_depend_on_which_sublayers_ran():
    # The sublayer `noise` runs only in training: the element "noise" is `net/noise#1`
    # in predict too (it was `net/noise` there, and a patch of `net/noise` hit the
    # element in predict and the Dense in fit).
    class Net(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.noise = layers.Dense(4, name="noise")

        def call(self, x, training=False):
            n = self.noise(x) if training else x
            return {"noise": n * 2.0, "clean": x}

    net = Net(name="net")
    net(X, training=True)
    assert {"net/noise#1", "net/clean"} <= set(cs.points(net, X))
    assert "net/noise" not in cs.points(net, X)
    with cs.capture(net, "net/noise#1") as cap, cs.patch(net, {"net/noise#1": lambda v: v + 1}):
        out = net.predict(X, verbose=0)
    np.testing.assert_allclose(cap["net/noise#1:output"], 2 * X + 1, rtol=1e-6)
    np.testing.assert_allclose(out["noise"], 2 * X + 1, rtol=1e-6)
    net.compile(optimizer=keras.optimizers.SGD(0.0), loss={"noise": "mse", "clean": "mse"})
    with cs.capture(net, ["net/noise", "net/noise#1"]) as cap:
        net.fit(X, {"noise": X, "clean": X}, batch_size=8, shuffle=False, verbose=0)
    w = [numpy(v) for v in net.noise.weights]
    dense = X @ w[0] + w[1]
    np.testing.assert_allclose(cap["net/noise:output"], dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap["net/noise#1:output"], 2 * dense, rtol=1e-5, atol=1e-6)


def test_keyword_inputs_are_recorded_by_argument_name():
    class Attend(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.mha = layers.MultiHeadAttention(num_heads=2, key_dim=2, name="mha")

        def call(self, x):
            return self.mha(query=x, value=2.0 * x)

    model = Attend(name="att")
    x = X.reshape(2, 4, 4)
    with cs.capture(model, "att/mha", kinds=("input",)) as cap:
        model.predict(x, verbose=0)
    assert sorted(cap) == ["att/mha:input/query", "att/mha:input/value"]
    np.testing.assert_allclose(cap["att/mha:input/query"], x)
    np.testing.assert_allclose(cap["att/mha:input/value"], 2.0 * x)
    with cs.capture(model, "att/mha/query", kinds=("input",)) as cap:  # the sublayer
        model.predict(x, verbose=0)
    np.testing.assert_allclose(cap["att/mha/query:input"], x)


def test_the_keys_of_a_dict_argument_are_escaped_in_its_input_labels():
    # `{"p/q": a, "p": {"q": b}}` gave both `input/x/p/q`, read as two runs
    # (`@0`, `@1`) of a layer that ran once; `"c:d"` a key with two colons.
    class Sum(layers.Layer):
        def call(self, x, **extra):
            return x["a"] + x["p/q"] + x["p"]["q"] + x["c:d"] + extra["k/w"]

    class Net(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.s = Sum(name="s")

        def call(self, x):
            return self.s({"a": x, "p/q": x * 5.0, "p": {"q": x * 11.0}, "c:d": x * 13.0},
                          **{"k/w": x * 17.0})

    model = Net(name="net")
    with cs.capture(model, "net/s", kinds=("input",)) as cap:
        model.predict(X, batch_size=2, verbose=0)
    factors = {"a": 1, "p%2Fq": 5, "p/q": 11, "c%3Ad": 13}
    assert sorted(cap) == sorted([f"net/s:input/x/{k}" for k in factors]
                                 + ["net/s:input/k%2Fw"])
    for label, factor in factors.items():
        np.testing.assert_allclose(cap[f"net/s:input/x/{label}"], X * factor)
    np.testing.assert_allclose(cap["net/s:input/k%2Fw"], X * 17)


# --------------------------------------------------------------------------
# Layers in loops
# --------------------------------------------------------------------------
def _text_model():
    return cs.Sequential([keras.Input((6,), dtype="int32"), layers.Embedding(20, 4, name="emb"),
                          layers.LSTM(5, return_sequences=True, name="lstm"),
                          layers.SimpleRNN(3, name="rnn"), layers.Dense(2, name="head")],
                         name="text")


def test_rnn_model_captures_every_point_and_refuses_the_cell():
    model = _text_model()
    tokens = np.random.default_rng(1).integers(0, 20, size=(5, 6)).astype("int32")
    assert set(cs.points(model, tokens)) == {"text", "text/emb", "text/lstm", "text/rnn",
                                             "text/head"}
    with cs.capture(model, "*") as cap:
        out = model.predict(tokens, batch_size=2, verbose=0)
    assert sorted(cap) == ["text/emb:output", "text/head:output", "text/lstm:output",
                           "text/rnn:output", "text:output"]
    stock = keras.Model(model.inputs, [model.get_layer("lstm").output,
                                       model.get_layer("rnn").output])
    lstm, rnn = stock.predict(tokens, verbose=0)
    np.testing.assert_allclose(cap["text/lstm:output"], lstm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap["text/rnn:output"], rnn, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cap["text:output"], out)
    with pytest.raises(cs.LoopPointError, match="text/lstm/lstm_cell.*inside a loop body.*"
                                                "Capture or patch `text/lstm`"):
        with cs.capture(model, "text/lstm/lstm_cell"):
            model.predict(tokens, verbose=0)
    with pytest.raises(cs.LoopPointError, match="text/rnn/simple_rnn_cell"):
        with cs.patch(model, {"text/rnn/simple_rnn_cell": keras.ops.zeros_like}):
            model.predict(tokens, verbose=0)
    with cs.patch(model, {"text/lstm": keras.ops.zeros_like}):  # the RNN itself patches
        patched = model.predict(tokens, verbose=0)
    assert not np.allclose(patched, out)


class ScanSow(layers.Layer):
    def call(self, x):
        def step(carry, row):
            carry = carry + cs.sow(self, "carry", row)
            return carry, carry

        total, _ = keras.ops.scan(step, ops.zeros_like(x[0]), x)
        return cs.sow(self, "total", total)


def test_sow_inside_a_users_scan_is_refused_alike_on_every_backend():
    model = cs.Sequential([keras.Input((4,)), ScanSow(name="scan")], name="m")
    with cs.capture(model, "*") as cap:
        model.predict(X, batch_size=8, verbose=0)
    assert sorted(cap) == ["m/scan/total:output", "m/scan:output", "m:output"]
    np.testing.assert_allclose(cap["m/scan/total:output"], X.sum(0), rtol=1e-5)
    with pytest.raises(cs.LoopPointError, match="m/scan/carry"):
        with cs.capture(model, "m/scan/carry"):
            model.predict(X, batch_size=8, verbose=0)


def _backend_vmap(fn, xs):
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.vectorized_map(fn, xs)
    if BACKEND == "torch":
        import torch

        return torch.vmap(fn)(xs)
    import jax

    return jax.vmap(fn)(xs)


class MapsOverTime(layers.Layer):
    """Maps its Dense over the time axis with the backend's own vectorizing map,
    or with Keras's TimeDistributed, whose time axis a boolean mask hides."""

    def __init__(self, own_map, **kwargs):
        super().__init__(**kwargs)
        self.own_map = own_map
        self.d = layers.Dense(3, name="d")
        self.td = layers.TimeDistributed(self.d, name="td")

    def build(self, shape):
        self.d.build(shape[:1] + shape[2:])

    def call(self, x):
        if self.own_map:
            out = _backend_vmap(lambda r: cs.sow(self, "z", self.d(r)),
                                ops.transpose(x, (1, 0, 2)))
            return ops.transpose(out, (1, 0, 2))
        if BACKEND == "tensorflow":  # (a time axis unknown while tracing)
            import tensorflow as tf

            x = tf.boolean_mask(x, tf.ones([tf.shape(x)[1]], bool), axis=1)
        return self.td(x)

    def compute_output_shape(self, shape):
        return (*shape[:-1], 3)


@pytest.mark.parametrize("own_map", [True, False])
def test_a_layer_in_a_vectorizing_map_is_a_loop_point(own_map):
    # TF's `vectorized_map` (a layer's own, or TimeDistributed's over an unknown
    # time axis) traced the body once: the point held time step 0 only, its
    # gradient 0; torch's `vmap` raised its own error even for "*".
    x = np.random.default_rng(0).normal(size=(6, 6, 4)).astype("float32")
    model = cs.Sequential([keras.Input((6, 4)), MapsOverTime(own_map, name="per")], name="m")
    model(x)
    kernel, bias = (numpy(v) for v in model.get_layer("per").d.weights)
    with cs.capture(model, "*") as cap:
        out = model.predict(x, batch_size=6, verbose=0)
    if own_map or BACKEND == "tensorflow":
        assert set(cap) == {"m/per:output", "m:output"} | (set() if own_map else {
            "m/per/td:output"})
        inner = "m/per/d" if own_map else "m/per/td/d"
        with pytest.raises(cs.LoopPointError, match=inner):
            with cs.capture(model, inner):
                model.predict(x, batch_size=6, verbose=0)
    np.testing.assert_allclose(out, x @ kernel + bias, rtol=1e-5, atol=1e-5)


class SowingCell(layers.Layer):
    state_size = output_size = 4

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = layers.Dense(4, name="inner")

    def call(self, x, states):
        h = cs.sow(self, "step", ops.tanh(self.inner(ops.concatenate([x, states[0]], -1))))
        return h, [h]


def test_a_default_capture_whose_only_sown_values_are_in_a_loop_says_so():
    # It said "no layer called `cs.sow`", and one did: inside the RNN's cell.
    model = cs.Sequential([keras.Input((3, 4)), layers.RNN(SowingCell(name="cell"),
                                                           name="rnn")], name="m")
    with pytest.raises(ValueError, match=r"selected nothing: no layer called `cs.sow` outside "
                       r"a loop body during the run: points inside one \(\[.*'m/rnn/cell/step'"
                       r".*\]\) are left out, since a value made there cannot leave it\. "
                       r"Capture \['m/rnn'\] instead"):
        with cs.capture(model):
            model.predict(np.ones((2, 3, 4), "float32"), verbose=0)


# --------------------------------------------------------------------------
# Quantized layers
# --------------------------------------------------------------------------
def test_quantized_layers_capture_and_patch():
    model = _seq()
    model.build((None, 4))
    with warnings.catch_warnings():  # Keras warns that the InputLayer cannot quantize
        warnings.simplefilter("ignore")
        model.quantize("int8")
    stock = keras.Model(model.inputs, model.get_layer("hidden").output)
    with cs.capture(model, "seq/hidden") as cap:
        model.predict(X, verbose=0)
    np.testing.assert_allclose(cap["seq/hidden:output"], stock.predict(X, verbose=0),
                               rtol=1e-5, atol=1e-6)
    with cs.patch(model, {"seq/hidden": keras.ops.zeros_like}):
        out = model.predict(X, verbose=0)
    stock_out = keras.Model(model.get_layer("out").input, model.get_layer("out").output)
    np.testing.assert_allclose(out, stock_out.predict(np.zeros((8, 5), "float32"), verbose=0),
                               rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# Patches across batches
# --------------------------------------------------------------------------
def test_array_patch_takes_each_batchs_rows():
    model = _seq()
    clean = np.random.default_rng(2).normal(size=(8, 5)).astype("float32")
    with cs.capture(model, "seq/act") as cap, cs.patch(model, {"seq/hidden": clean}):
        model.predict(X, batch_size=3, verbose=0)  # batches of 3, 3, 2
    np.testing.assert_allclose(cap["seq/act:output"], np.maximum(clean, 0))
    with pytest.raises(ValueError, match="has 8 rows, but this call's data runs to row 9"):
        with cs.patch(model, {"seq/hidden": clean}):
            model.predict(np.concatenate([X, X[:1]]), batch_size=3, verbose=0)
    with pytest.raises(ValueError, match="has 8 rows, but this call's data had 7"):
        with cs.patch(model, {"seq/hidden": clean}):
            model.predict(X[:7], batch_size=3, verbose=0)


def test_patch_function_of_the_batch_gets_row_offsets():
    model = _seq()
    offsets = np.arange(8, dtype="float32")[:, None]

    def add_row_index(value, batch):
        rows = ops.cast(ops.arange(batch.rows) + batch.start, value.dtype)
        return value * 0.0 + rows[:, None]

    with cs.capture(model, "seq/hidden") as cap, cs.patch(model, {"seq/hidden": add_row_index}):
        model.predict(X, batch_size=3, verbose=0)
    np.testing.assert_allclose(cap["seq/hidden:output"], np.broadcast_to(offsets, (8, 5)))
    model.compile(optimizer="sgd", loss="mse")
    with cs.capture(model, "seq/hidden") as cap, cs.patch(model, {"seq/hidden": add_row_index}):
        model.evaluate(X, np.zeros((8, 2)), batch_size=4, verbose=0)
    np.testing.assert_allclose(cap["seq/hidden:output"], np.broadcast_to(offsets, (8, 5)))


def test_patch_of_the_wrong_shape_names_the_point_and_both_shapes():
    model = _seq()
    other_run = np.ones((8, 5), "float32")
    with pytest.raises(ValueError, match=r"patch of `seq/hidden` returned a value of shape "
                                         r"\(8, 5\).*has shape \((4|None), 5\)"):
        with cs.patch(model, {"seq/hidden": lambda v: ops.convert_to_tensor(other_run)}):
            model.predict(X, batch_size=4, verbose=0)


def test_patch_never_reached_raises_at_the_end_of_each_run():
    model = _seq()
    with pytest.raises(ValueError, match=r"never reached \['seq/hiden'\] in this `predict`"):
        with cs.patch(model, {"seq/hiden": keras.ops.zeros_like}):
            model.predict(X, verbose=0)


# --------------------------------------------------------------------------
# Sown names, disk
# --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a|b", "a/b", "x:y", "", "h@0", "w*", "a%40b"])
def test_sow_names_are_validated(name):
    class Sower(layers.Layer):
        def call(self, x):
            return cs.sow(self, name, x)

    with pytest.raises(ValueError, match=r"`cs.sow` takes a non-empty name.*Received: name="):
        model = cs.Sequential([keras.Input((4,)), Sower(name="s")], name="m")
        model.predict(X, verbose=0)


class _SowsASublayersName(layers.Layer):
    def __init__(self, sown, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")
        self.sown = sown

    def call(self, x):
        h = self.dense(x)
        cs.sow(self, self.sown, h + 100.0)
        return {"h": h, "relu": ops.relu(h)}


@pytest.mark.parametrize("sown, clash", [("dense", r"the output of the sublayer there \(`dense`\)"),
                                         ("relu", "an element of its output")])
def test_a_sown_name_that_is_already_a_point_is_refused(sown, clash):
    """A sow named like a sublayer (or an output element) would share its point,
    read back as `@0` and `@1` of one point that ran once: refused wherever the
    points are named (capture, patch, cs.points), the default capture included."""
    inputs = keras.Input((4,))
    model = cs.Model(inputs, _SowsASublayersName(sown, name="b0")(inputs)["h"], name="net")
    compiled = (r" \(or, under torch.compile, `jit_compile=True`, any value: layers cannot "
                r"note there which value is which\)" if BACKEND == "torch" else "")
    message = (rf"`cs.sow\(self, '{sown}', ...\)` in `b0` names the point `net/b0/{sown}`, "
               rf"which is also {clash}, with a value that is not that output itself"
               rf"{compiled}: .*Received: name='{sown}'")
    for run in (lambda: cs.points(model, X),
                lambda: _captured(model, f"net/b0/{sown}"),
                lambda: _captured(model, None),
                lambda: _patched(model, f"net/b0/{sown}")):
        with pytest.raises(ValueError, match=message):
            run()
    np.testing.assert_allclose(model.predict(X, verbose=0),  # nothing left behind
                               numpy(model.get_layer("b0").dense(X)), rtol=1e-6)
    fine = cs.Model(inputs, _SowsASublayersName("pre", name="b0")(inputs)["h"], name="net")
    with cs.capture(fine, ["net/b0/dense", "net/b0/pre"]) as cap:
        fine.predict(X, verbose=0)
    assert sorted(cap.keys()) == ["net/b0/dense:output", "net/b0/pre:output"]
    np.testing.assert_allclose(cap["net/b0/pre:output"], cap["net/b0/dense:output"] + 100.0,
                               rtol=1e-6)


class _SowsASublayersOutput(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = layers.Dense(4, activation="sigmoid")

    def call(self, x):
        return x * cs.sow(self, "gate", self.gate(x))  # its point is the sublayer's


def test_a_sublayers_own_output_sown_under_its_point_is_that_one_point():
    """`self.gate` sown as "gate" names the sublayer's point with its very output:
    one point that ran once, selected by default and by name, patched once."""
    inputs = keras.Input((4,))
    model = cs.Model(inputs, _SowsASublayersOutput(name="b0")(inputs), name="net")
    gate = numpy(model.get_layer("b0").gate(X))
    assert sorted(cs.points(model, X)) == ["net", "net/b0", "net/b0/gate"]
    for select in (None, "net/b0/gate", ["*", "net/b0/gate"]):
        with cs.capture(model, select) as cap:
            model.predict(X, verbose=0)
        keys = [k for k in cap.keys() if k.startswith("net/b0/gate")]
        assert keys == ["net/b0/gate:output"], (select, sorted(cap.keys()))
        np.testing.assert_allclose(cap["net/b0/gate:output"], gate, rtol=1e-6)
    with cs.patch(model, {"net/b0/gate": lambda g: g * 2.0}):  # once, not twice
        np.testing.assert_allclose(model.predict(X, verbose=0), X * 2.0 * gate, rtol=1e-5)


class _OneValueTwoWays(layers.Layer):
    """A sublayer's output sown under its point twice, one sown inside a loop
    body, and a value sown and returned under its element's point."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = layers.Dense(4, activation="sigmoid")
        self.looped = layers.Dense(4)
        self.listed = _Listed(name="listed")

    def call(self, x):
        g = self.gate(x)
        cs.sow(self, "gate", g)
        cs.sow(self, "gate", g)  # the same value again: still the one point

        def body(i, h):
            return cs.sow(self, "looped", self.looped(h))

        looped = ops.fori_loop(0, 2, body, x)
        (listed,) = self.listed(x)
        cs.sow(self, "listed", listed)  # the one tensor of the sublayer's output
        h = cs.sow(self, "h", g * 2.0)
        return {"h": h, "rest": looped + listed}


class _Listed(layers.Layer):
    def call(self, x):
        return [x * 3.0]


class _SowsAnAttentionsName(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mha = layers.MultiHeadAttention(1, 2)

    def call(self, x):
        seq = ops.reshape(x, (-1, 2, 2))
        attended, _ = self.mha(seq, seq, return_attention_scores=True)
        cs.sow(self, "mha", attended)  # one of its two tensors, under the call's point
        return ops.reshape(attended, (-1, 4))


def test_one_value_named_two_ways_is_one_point():
    inputs = keras.Input((4,))
    layer = _OneValueTwoWays(name="b0")
    model = cs.Model(inputs, layer(inputs)["h"], name="net")
    gate = numpy(layer.gate(X))
    points = cs.points(model, X)
    assert {"net/b0/gate", "net/b0/h", "net/b0/listed"} <= set(points), points
    assert not any("@" in p for p in points), points
    assert "net/b0/looped" not in points  # in a loop body: not a point
    for select in (None, "*"):
        with cs.capture(model, select) as cap:
            model.predict(X, verbose=0)
        keys = sorted(k for k in cap.keys() if k.startswith(("net/b0/gate", "net/b0/h")))
        assert keys == ["net/b0/gate:output", "net/b0/h:output"], (select, keys)
        np.testing.assert_allclose(cap["net/b0/gate:output"], gate, rtol=1e-6)
        np.testing.assert_allclose(cap["net/b0/h:output"], gate * 2.0, rtol=1e-6)
    with cs.capture(model, "net/b0/listed") as cap:
        model.predict(X, verbose=0)
    assert list(cap.keys()) == ["net/b0/listed:output"]
    np.testing.assert_allclose(cap["net/b0/listed:output"], X * 3.0, rtol=1e-6)
    with cs.patch(model, {"net/b0/h": lambda h: h + 1.0}):  # once, at the sow
        np.testing.assert_allclose(model.predict(X, verbose=0), gate * 2.0 + 1.0, rtol=1e-5)
    # Its gradient is taken where it is sown; a selection of the layer's output
    # elements only would take it at the output: refused, not half the answer.
    model.compile(loss="mse")
    with pytest.raises(ValueError, match=r"`net/b0/h` is sown inside `net/b0`'s call .*"
                                         r"Received: a gradient capture that selects"):
        with cs.capture(model, "net/b0", kinds=("output", "grad")):
            model.evaluate(X, X, verbose=0)
    with cs.capture(model, ["net/b0", "net/b0/h"], kinds=("grad",)) as cap:
        model.evaluate(X, X, verbose=0)
    assert "net/b0/h:grad" in cap.keys()


def test_a_sow_named_as_a_sublayer_with_several_tensors_is_refused():
    inputs = keras.Input((4,))
    model = cs.Model(inputs, _SowsAnAttentionsName(name="b0")(inputs), name="net")
    with pytest.raises(ValueError, match=r"names the point `net/b0/mha`, which is also "
                                         r"the output of the sublayer there"):
        cs.points(model, X)


def _captured(model, select):
    with cs.capture(model, select):
        model.predict(X, verbose=0)


def _patched(model, point):
    with cs.patch(model, {point: keras.ops.zeros_like}):
        model.predict(X, verbose=0)


def test_to_refuses_a_directory_with_files_unless_overwrite(tmp_path):
    model = _seq()
    (tmp_path / "0000.bin").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        with cs.capture(model, "seq/hidden", to=tmp_path):
            model.predict(X, verbose=0)
    assert (tmp_path / "0000.bin").read_bytes() == b"mine"
    with cs.capture(model, "seq/hidden", to=tmp_path, overwrite=True) as cap:
        model.predict(X, verbose=0)
    assert not (tmp_path / "0000.bin").exists()
    np.testing.assert_allclose(cap["seq/hidden:output"],
                               keras.Model(model.inputs, model.get_layer("hidden").output)
                               .predict(X, verbose=0), rtol=1e-6)


# --------------------------------------------------------------------------
# Histogram ranges: from the first batch each kind of step sees
# --------------------------------------------------------------------------
def _bn_model():
    return cs.Sequential([keras.Input((4,)), layers.Dense(6, name="dense"),
                          layers.BatchNormalization(name="bn"), layers.Dropout(0.3, name="drop"),
                          layers.Dense(1, name="out")], name="bnnet")


def test_fit_hist_range_is_the_first_training_batchs_range():
    model = _bn_model()
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(3).normal(size=(40, 4)).astype("float32") * 50
    y = np.random.default_rng(4).normal(size=(40, 1)).astype("float32")
    with cs.capture(model, ["bnnet/bn", "bnnet/drop"], kinds=("output", "grad"),
                    reduce=("hist", "min", "max"), bins=8) as cap:
        model.fit(x, y, batch_size=16, epochs=1, shuffle=True, verbose=0)
    for key in ("bnnet/bn:output", "bnnet/drop:output", "bnnet/bn:grad"):
        lo, hi = cap[f"{key}/min"][0], cap[f"{key}/max"][0]  # what step 0 saw, in training
        np.testing.assert_allclose(cap.hist_edges(f"{key}/hist"), np.linspace(lo, hi, 9),
                                   rtol=1e-4, atol=1e-6)
        first = cap[f"{key}/hist"][0]
        assert first[0] > 0 and first[-1] > 0 and first.sum() == 16 * 6
    # Training-mode BatchNormalization keeps step 0 near N(0, 1), whatever x's scale.
    assert -10 < cap["bnnet/bn:output/min"][0] < 0 < cap["bnnet/bn:output/max"][0] < 10


def test_hist_range_per_kind_and_from_a_dataset():
    model = _bn_model()
    model.compile(optimizer="sgd", loss="mse")

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            rows = np.random.default_rng(i).normal(size=(4, 4)).astype("float32")
            return rows, np.zeros((4, 1), "float32")

    with cs.capture(model, "bnnet/dense", kinds=("output", "grad"), reduce=("hist", "min", "max"),
                    bins=4, hist_range={"grad": (-0.5, 0.5)}) as cap:
        model.evaluate(Batches(), verbose=0)
    np.testing.assert_allclose(cap.hist_edges("bnnet/dense:grad/hist"), [-0.5, -0.25, 0, 0.25, 0.5])
    edges = cap.hist_edges("bnnet/dense:output/hist")
    first = Batches()[0][0] @ numpy(model.get_layer("dense").kernel) \
        + numpy(model.get_layer("dense").bias)
    np.testing.assert_allclose(edges, np.linspace(first.min(), first.max(), 5), rtol=1e-5)
    assert cap["bnnet/dense:output/hist"].sum() == 3 * 4 * 6
    with pytest.raises(ValueError, match=r"`hist_range` takes \(lo, hi\).*Received: hist_range="):
        cs.capture(model, "*", reduce="hist", hist_range={"weights": (0, 1)})


# --------------------------------------------------------------------------
# Edges found in review
# --------------------------------------------------------------------------
def test_batch_patches_are_refused_in_fit_and_reached_is_per_kind_of_step():
    model = _seq()
    model.compile(optimizer="sgd", loss="mse")
    y = np.zeros((8, 2), "float32")
    with pytest.raises(ValueError, match=r"`fit` shuffles and repeats.*Received: a batch "
                                         r"patch in fit"):
        with cs.patch(model, {"seq/hidden": np.zeros((8, 5), "float32")}):
            model.fit(X, y, verbose=0)

    class TrainOnly(layers.Layer):
        def call(self, x, training=None):
            return cs.sow(self, "noise", x + 1.0) if training else x

    model = cs.Sequential([keras.Input((4,)), TrainOnly(name="t"), layers.Dense(4, name="d")],
                          name="m")
    model.compile(optimizer="sgd", loss="mse")
    zero = keras.ops.zeros_like
    with cs.patch(model, {"m/t/noise": zero}):
        model.fit(X, X, epochs=1, verbose=0)  # reached in training
        with pytest.raises(ValueError, match=r"never reached \['m/t/noise'\] in this "
                                             r"`predict`"):
            model.predict(X, verbose=0)  # the same key, but predict never reaches it


def test_inner_model_capture_on_the_outer_models_first_fit():
    inner = cs.Sequential([keras.Input((4,)), layers.Dense(3, name="d")], name="enc")
    outer = cs.Sequential([keras.Input((4,)), inner, layers.Dense(2, name="head")], name="ae")
    outer.compile(optimizer="sgd", loss="mse")
    with cs.capture(inner, "enc/d") as cap:
        outer.fit(X, np.zeros((8, 2), "float32"), batch_size=8, shuffle=False, verbose=0)
    assert cap["enc/d:output"].shape == (1, 8, 3) or cap["enc/d:output"].shape == (8, 3)


def test_a_subclassed_models_name_survives_saving(tmp_path):
    @keras.saving.register_keras_serializable("test_points")
    class Encoder(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.proj = layers.Dense(2)

        def call(self, x):
            return self.proj(x)

    model = Encoder(name="encoder")
    points = cs.points(model, X)
    assert points == {"encoder": (8, 2), "encoder/proj": (8, 2)}
    model.save(tmp_path / "e.keras")
    for _ in range(2):  # Keras's name counter moves on with each load
        assert cs.points(keras.saving.load_model(tmp_path / "e.keras"), X) == points


def test_layers_in_a_branch_of_cond_are_refused_alike():
    class Branchy(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = layers.Dense(4, name="inner")

        def call(self, x):
            return keras.ops.cond(ops.sum(x) > 0, lambda: self.inner(x), lambda: x)

    model = cs.Sequential([keras.Input((4,)), Branchy(name="b")], name="m")
    positive = np.abs(X)  # torch runs only the branch taken: take the one with the layer
    assert set(cs.points(model, positive)) == {"m", "m/b"}
    with pytest.raises(cs.LoopPointError, match="m/b/inner.*branch of keras.ops.cond"):
        with cs.capture(model, "m/b/inner"):
            model.predict(positive, verbose=0)


def test_names_keras_made_up_are_told_from_the_users_own(tmp_path):
    class Unnamed(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self._soft = layers.Softmax()  # Keras names it softmax, softmax_1, ...

        def call(self, x):
            return self._soft(x)

    extra = [Unnamed() for _ in range(3)]  # takes "unnamed", "unnamed_1", "unnamed_2"
    model = cs.Sequential([keras.Input((4,)), Unnamed(name="unnamed_1"), Unnamed()],
                          name="m")
    del extra
    points = cs.points(model, X)
    # The user's own "unnamed_1" keeps its name; Keras's names inside are replaced
    # by the attribute that holds them.
    assert set(points) == {"m", "m/unnamed_1", "m/unnamed_1/soft", f"m/{model.layers[1].name}",
                           f"m/{model.layers[1].name}/soft"}
    keras.utils.clear_session()  # Keras's name counters start again: no matter
    assert cs.points(model, X) == points


def test_listing_the_points_leaves_a_stateful_models_state():
    # `cs.points` and `cs.summary` run the model: a stateful RNN's state moved.
    x = np.random.default_rng(0).normal(size=(4, 5, 3)).astype("float32")
    inp = keras.Input((5, 3), batch_size=4)
    model = cs.Model(inp, layers.LSTM(6, stateful=True, name="r")(inp), name="m")
    model(x)  # (a state of its own, not zeros)
    before = [numpy(v).copy() for v in model.non_trainable_variables]
    assert cs.points(model, x) == {"m": (4, 6), "m/r": (4, 6)}
    cs.summary(model, x, print_fn=lambda text: None)
    for variable, value in zip(model.non_trainable_variables, before):
        np.testing.assert_array_equal(numpy(variable), value, err_msg=variable.path)


def test_the_runs_of_a_layer_are_numbered_by_its_calls_in_every_key():
    # `@i` counted the values each key got: `input/key`, given in runs 0 and 2,
    # read run 2's as `@1`, beside `@1:input/query` (run 1's); run 1 returned a
    # tuple, so `@1:output` was run 2's; a key only run 1 gave had no `@` at all.
    class Attend(layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="ones")

        def call(self, query, key=None, pair=False):
            out = query @ self.w + (0.0 if key is None else key)
            return (out, 2.0 * out) if pair else out

    class Net(cs.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.att = Attend(name="att")

        def call(self, x):
            a = self.att(x, key=2.0 * x)
            b = self.att(a, pair=True)[1]
            return self.att(b, key=5.0 * x)

    model = Net(name="net")
    model.compile(loss="mse")
    y = np.zeros((8, 4), "float32")
    w = np.ones((4, 4), "float32")
    a = X @ w + 2 * X
    b = 2 * (a @ w)
    c = b @ w + 5 * X
    with cs.capture(model, "net/att", kinds=("input", "output", "grad")) as cap:
        model.evaluate(X, y, batch_size=8, verbose=0)
    assert sorted(cap) == sorted([
        "net/att@0:input/query", "net/att@0:input/key", "net/att@0:output", "net/att@0:grad",
        "net/att@1:input", "net/att/0@1:output", "net/att/1@1:output", "net/att/0@1:grad",
        "net/att/1@1:grad",
        "net/att@2:input/query", "net/att@2:input/key", "net/att@2:output", "net/att@2:grad"])
    for key, expected in [("net/att@0:input/query", X), ("net/att@0:input/key", 2 * X),
                          ("net/att@0:output", a), ("net/att@1:input", a),
                          ("net/att/1@1:output", b), ("net/att@2:input/query", b),
                          ("net/att@2:input/key", 5 * X), ("net/att@2:output", c)]:
        np.testing.assert_allclose(cap[key], expected, rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(cap["net/att@2:grad"], 2 * c / c.size, rtol=1e-5)
    np.testing.assert_allclose(cap["net/att/0@1:grad"], 0, atol=0)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    with cs.capture(model, "net/att", kinds=("input", "output", "grad")) as fitted:
        model.fit(X, y, batch_size=8, verbose=0, shuffle=False)  # (JAX: in value_and_grad)
    assert sorted(fitted) == sorted(cap)
    for key in ("net/att@0:input/key", "net/att@2:input/key", "net/att@2:output",
                "net/att@2:grad"):
        np.testing.assert_allclose(fitted[key], cap[key], rtol=1e-5, err_msg=key)
