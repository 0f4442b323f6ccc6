"""d loss / d intermediate inside compiled and eager steps, against backend autodiff."""

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy

import callscope as cs

rng = np.random.default_rng(0)
X = rng.normal(size=(6, 4)).astype("float32")
Y = rng.normal(size=(6, 2)).astype("float32")
W = np.array([1.0, 0.5, 2.0, 0.0, 1.5, 1.0], "float32")
MODES = ["compiled", "eager"]


class Block(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return keras.ops.tanh(cs.sow(self, "pre_act", self.dense(x)))


class Net(cs.Model):
    def __init__(self):
        super().__init__(name="net")
        self.b0 = Block(3, name="b0")
        self.b1 = Block(2, name="b1")

    def call(self, x):
        return self.b1(self.b0(x))


def _net(mode):
    keras.utils.set_random_seed(0)
    net = Net()
    net.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", run_eagerly=mode == "eager")
    net(X)
    return net


def _autodiff(fn, h):
    """d fn(h) / d h with the backend's own autodiff (the eager reference)."""
    if BACKEND == "jax":
        import jax

        return np.asarray(jax.grad(lambda v: fn(v))(keras.ops.convert_to_tensor(h)))
    if BACKEND == "tensorflow":
        import tensorflow as tf

        v = tf.constant(h)
        with tf.GradientTape() as tape:
            tape.watch(v)
            out = fn(v)
        return tape.gradient(out, v).numpy()
    import torch

    v = torch.tensor(h, requires_grad=True)
    fn(v).backward()
    return v.grad.numpy()


def _reference_grads(net, x, y, w=None):
    """d loss / d b0 pre-activation and d loss / d b1 output, by backend autodiff."""
    w0, c0 = (numpy(v) for v in net.b0.dense.weights)
    w1, c1 = (numpy(v) for v in net.b1.dense.weights)
    w = np.ones(len(x), "float32") if w is None else w
    ops = keras.ops

    t = ops.convert_to_tensor

    def loss_from_out(out):  # Keras mse, sum_over_batch_size, with sample weights
        per_sample = ops.mean(ops.square(ops.subtract(out, t(y))), axis=-1)
        return ops.sum(ops.multiply(per_sample, t(w))) / len(x)

    def loss_from_p0(p0):
        return loss_from_out(ops.tanh(ops.add(ops.matmul(ops.tanh(p0), t(w1)), t(c1))))

    p0 = x @ w0 + c0
    out = np.tanh(np.tanh(p0) @ w1 + c1)
    analytic_out = 2 * (out - y) * w[:, None] / out.size
    return {
        "net/b0/pre_act:grad": _autodiff(loss_from_p0, p0.astype("float32")),
        "net/b1:grad": _autodiff(loss_from_out, out.astype("float32")),
        "analytic net/b1:grad": analytic_out,
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["fit", "evaluate", "train_on_batch", "test_on_batch"])
def test_grads_match_backend_autodiff_with_sample_weights(method, mode):
    net = _net(mode)
    ref = _reference_grads(net, X, Y, W)
    with cs.capture(net, ["net/b0/pre_act", "net/b1"], kinds=("grad",)) as cap:
        if method == "fit":
            net.fit(X, Y, sample_weight=W, batch_size=6, epochs=1, shuffle=False, verbose=0)
        elif method == "evaluate":
            net.evaluate(X, Y, sample_weight=W, batch_size=6, verbose=0)
        elif method == "train_on_batch":
            net.train_on_batch(X, Y, sample_weight=W)
        else:
            net.test_on_batch(X, Y, sample_weight=W)
    assert sorted(cap) == ["net/b0/pre_act:grad", "net/b1:grad"]
    for key in cap:
        np.testing.assert_allclose(cap[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(ref["net/b1:grad"], ref["analytic net/b1:grad"], rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("method", ["fit", "train_on_batch"])
@pytest.mark.parametrize("scaling", ["LossScaleOptimizer", "loss_scale_factor"])
def test_a_loss_scale_optimizer_never_scales_the_captured_grads(method, scaling):
    # Keras differentiates the loss times the scale (2**15 here); d loss / d point
    # is of the loss itself. On torch the grads come from the step's own backward
    # pass, so this checks they are divided by exactly what it started from. Any
    # optimizer's `loss_scale_factor` scales it too (the grads came 2**15 times).
    keras.utils.set_random_seed(0)
    net = Net()
    if scaling == "LossScaleOptimizer":
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0),
                                                        initial_scale=2.0**15)
    else:
        optimizer = keras.optimizers.SGD(0.0, loss_scale_factor=2.0**15)
    net.compile(optimizer=optimizer, loss="mse")
    net(X)
    ref = _reference_grads(net, X, Y)
    with cs.capture(net, ["net/b0/pre_act", "net/b1"], kinds=("grad",)) as cap:
        if method == "fit":
            net.fit(X, Y, batch_size=6, epochs=1, shuffle=False, verbose=0)
        else:
            net.train_on_batch(X, Y)
    assert float(numpy(optimizer.scale_loss(1.0))) == 2.0**15  # the step was scaled
    for key in ("net/b0/pre_act:grad", "net/b1:grad"):
        np.testing.assert_allclose(cap[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("method", ["fit", "train_on_batch"])
def test_mixed_float16_grads_keep_what_loss_scaling_keeps(method):
    # Unscaled and cast back to float16, gradients of about 1e-7 came 13-20% off,
    # a quarter of them 0 (float16 rounds under 6e-5 and flushes under 6e-8), and
    # their statistics with them. Now unscaled into float32, as exact as the
    # scaled float16 gradient the step's own backward holds.
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model = cs.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="pre"),
                               keras.layers.Dense(4, name="head", dtype="float32")], name="m")
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    kernel = numpy(model.get_layer("head").kernel).astype("float64")
    for residual, finite in [(1e-5, True), (1e4, False)]:
        y = model.predict(x, verbose=0) + np.float32(residual)
        with cs.capture(model, ["m/head", "m/pre"], kinds=("output", "grad")) as cap, \
                cs.capture(model, "m/pre", kinds=("grad",), reduce="rms") as rms:
            if method == "fit":
                model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
            else:
                model.train_on_batch(x, y)
        out = cap["m/head:output"].astype("float64")
        want = (2.0 * (out - y) / out.size) @ kernel.T  # d mse / d pre
        got = cap["m/pre:grad"]
        assert cap["m/pre:output"].dtype == np.float16 and got.dtype == np.float32
        if finite:  # (a step whose scaled gradients overflow: Keras skips it, and they
            # read inf or NaN on every backend)
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=np.abs(want).max() * 2e-3)
            assert float(rms["m/pre:grad/rms"][0]) == pytest.approx(
                np.sqrt((want ** 2).mean()), rel=2e-3)
        else:
            assert not np.isfinite(got).all()


def test_grads_in_fit_are_from_the_same_step_that_updates_weights():
    keras.utils.set_random_seed(0)
    net = Net()
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    net(X)
    first = _reference_grads(net, X[:3], Y[:3])["net/b1:grad"]
    with cs.capture(net, "net/b1", kinds=("grad", "output")) as cap:
        history = net.fit(X, Y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    assert set(history.history) == {"loss"}
    assert cap["net/b1:grad"].shape == (6, 2) and cap["net/b1:output"].shape == (6, 2)
    np.testing.assert_allclose(cap["net/b1:grad"][:3], first, rtol=1e-5, atol=1e-7)
    # the second step ran after the first update: its gradient differs from step-0 weights
    assert not np.allclose(cap["net/b1:grad"][3:], _reference_grads(_net("compiled"), X[3:],
                                                                   Y[3:])["net/b1:grad"])


def test_class_weights_equal_the_matching_sample_weights():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, name="hidden")(inputs)
    model = cs.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    labels = np.array([0, 1, 2, 1, 0, 2])
    class_weight = {0: 1.0, 1: 3.0, 2: 0.5}
    with cs.capture(model, "*/hidden", kinds=("grad",)) as by_class:
        model.fit(X, labels, class_weight=class_weight, batch_size=6, shuffle=False, verbose=0)
    weights = np.array([class_weight[c] for c in labels], "float32")
    with cs.capture(model, "*/hidden", kinds=("grad",)) as by_sample:
        model.fit(X, labels, sample_weight=weights, batch_size=6, shuffle=False, verbose=0)
    np.testing.assert_allclose(by_class["functional/hidden:grad"],
                               by_sample["functional/hidden:grad"], rtol=1e-6)
    assert np.abs(by_class["functional/hidden:grad"]).max() > 0


def test_gradient_norm_statistics_per_step():
    net = _net("compiled")
    with cs.capture(net, "net/b?", kinds=("grad",), reduce=("rms", "absmax")) as cap:
        net.fit(X, Y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    rms = cap["net/b1:grad/rms"]
    assert rms.shape == (3,)
    for step in range(3):
        rows = slice(2 * step, 2 * step + 2)
        ref = _reference_grads(net, X[rows], Y[rows])["net/b1:grad"]
        assert rms[step] == pytest.approx(np.sqrt((ref ** 2).mean()), rel=1e-5)


def test_grads_need_a_loss():
    net = _net("compiled")
    with pytest.raises(ValueError, match="needs a loss.*`predict` has none"):
        with cs.capture(net, kinds=("grad",)):
            net.predict(X, verbose=0)
    keras.utils.set_random_seed(0)
    uncompiled = Net()
    with pytest.raises(ValueError, match="needs a compiled model"):
        with cs.capture(uncompiled, kinds=("grad",)):
            uncompiled.train_on_batch(X, Y)


def test_intermediate_grads_helper_for_your_own_steps():
    net = _net("compiled")
    ref = _reference_grads(net, X, Y, W)
    loss_fn = keras.losses.MeanSquaredError()
    x, y, w = (keras.ops.convert_to_tensor(a) for a in (X, Y, W))
    if BACKEND == "jax":  # the stateless style: a pure function of the state
        tv = [v.value for v in net.trainable_variables]
        ntv = [v.value for v in net.non_trainable_variables]

        def compute(tv, x):
            y_pred, _ = net.stateless_call(tv, ntv, x, training=True)
            return loss_fn(y, y_pred, sample_weight=w), y_pred

        result = cs.intermediate_grads(net, compute, tv, x, select=["net/b0/pre_act", "net/b1"])
    else:
        def compute(x):
            y_pred = net(x, training=True)
            return loss_fn(y, y_pred, sample_weight=w), y_pred

        result = cs.intermediate_grads(net, compute, x, select=["net/b0/pre_act", "net/b1"])
    assert sorted(result.grads) == ["net/b0/pre_act:grad", "net/b1:grad"]
    for key, value in result.grads.items():
        np.testing.assert_allclose(numpy(value), ref[key], rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(numpy(result.outputs["net/b1:output"]), numpy(result.aux),
                               rtol=1e-6)
    assert float(numpy(result.loss)) > 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_intermediate_grads_take_context_values(dynamic):
    """d sum((scale * h)^2) / dh = 2 scale^2 h, with h = 3, for a value passed to
    the model's call in `loss_fn`, and for a scope value where `loss_fn` runs
    eagerly (TF, torch). JAX traces `loss_fn`, which may call a function compiled
    before with another value: a scope value raises there, naming the fix."""

    @cs.context_args("scale")
    class Scale(keras.layers.Layer):
        def call(self, h, scale=None):
            return h if scale is None else h * scale

    class Net(cs.Model):
        def __init__(self):
            super().__init__(name="net")
            self.d = keras.layers.Dense(1, kernel_initializer="ones", name="d")
            self.s = Scale(name="s")
            self.register_context_args("scale", dynamic=dynamic)

        def call(self, x):
            return self.s(self.d(x))

    x = keras.ops.ones((4, 3))
    net = Net()
    net(x)

    def loss_fn(x, **given):
        if BACKEND == "jax":
            tv = [v.value for v in net.trainable_variables]
            ntv = [v.value for v in net.non_trainable_variables]
            return keras.ops.sum(net.stateless_call(tv, ntv, x, **given)[0] ** 2)
        return keras.ops.sum(net(x, **given) ** 2)

    def grad(fn):
        return numpy(cs.intermediate_grads(net, fn, x, select="net/d").grads["net/d:grad"])

    np.testing.assert_allclose(grad(loss_fn), np.full((4, 1), 6.0))
    for scale in (3.0, 0.5):
        expected = np.full((4, 1), 6.0 * scale**2)
        np.testing.assert_allclose(grad(lambda x, s=scale: loss_fn(x, scale=s)), expected,
                                   rtol=1e-6)
        with cs.context(scale=scale):
            if BACKEND == "jax":
                with pytest.raises(RuntimeError,
                                   match=r"`loss_fn` on JAX .*stateless_call\(\.\.\., scale="):
                    grad(loss_fn)
            else:
                np.testing.assert_allclose(grad(loss_fn), expected, rtol=1e-6)


@pytest.mark.skipif(BACKEND != "torch", reason="only torch runs steps eagerly, with live tensors")
@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_a_gradient_capture_keeps_no_step_tensor_alive(method):
    """Each step's activations (and the graph behind them) die with the step. The
    gradient hooks torch keeps in C++ once held them in a cycle that Python's
    collector cannot see: 16 MiB a step stayed alive, for good."""
    import gc
    import weakref

    alive = []

    class Watched(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(8, activation="relu")

        def call(self, x):
            h = self.dense(x)
            alive.append(weakref.ref(h))
            return h

    inputs = keras.Input((4,))
    model = cs.Model(inputs, keras.layers.Dense(1)(Watched(name="w")(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
    with cs.capture(model, "*/w", kinds=("output", "grad")) as cap:
        getattr(model, method)(x, y, batch_size=8, verbose=0)
    assert cap["functional/w:grad"].shape == (32, 8) and len(alive) >= 4
    gc.collect()
    assert [r for r in alive if r() is not None] == []
