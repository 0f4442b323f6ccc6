"""Edges of d loss / d point, alike on every backend: empty selections, steps that
call `compute_loss` twice, sources that are one tensor, and one run of `loss_fn`."""

import contextlib

import keras
import numpy as np
import pytest
from conftest import BACKEND, numpy

import callscope as cs

rng = np.random.default_rng(0)
X = rng.normal(size=(5, 3)).astype("float32")
Y = rng.normal(size=(5, 1)).astype("float32")
METHODS = ["fit", "evaluate", "train_on_batch", "test_on_batch"]
ONE_LOSS = "called `compute_loss` more than once"


def _layers():
    return [keras.Input((3,)), keras.layers.Dense(4, name="d1"), keras.layers.Dense(1, name="d2")]


def _model(cls=None, run_eagerly=False):
    keras.utils.set_random_seed(0)
    model = (cls or cs.Sequential)(_layers(), name="m")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", run_eagerly=run_eagerly)
    return model


def _one(mapping, suffix):
    """The value whose key is `.../<suffix>`: point names may grow prefixes."""
    found = [mapping[k] for k in mapping if k == suffix or k.endswith("/" + suffix)]
    assert len(found) == 1, (suffix, sorted(mapping))
    return numpy(found[0])


def _weights(model, name):
    return [numpy(v) for v in model.get_layer(name).weights]


def _reference(model, x=X, y=Y, scale=1.0):
    """d (scale * mse) / d each Dense output, by hand (numpy)."""
    w1, b1 = _weights(model, "d1")
    w2, b2 = _weights(model, "d2")
    h = x @ w1 + b1
    out = h @ w2 + b2
    d_out = scale * 2 * (out - y) / out.size
    return {"d1": d_out @ w2.T, "d2": d_out, "loss": scale * np.mean((out - y) ** 2)}


def _run(model, method):
    if method == "fit":
        model.fit(X, Y, batch_size=len(X), epochs=1, shuffle=False, verbose=0)
    elif method == "evaluate":
        model.evaluate(X, Y, batch_size=len(X), verbose=0)
    else:
        getattr(model, method)(X, Y)


def _mse_fn(model, y=Y):
    """`(fn, args)` for `cs.intermediate_grads`: mse of `model` on X, in each
    backend's style (JAX: a pure function of the weights and the inputs)."""
    y = keras.ops.convert_to_tensor(y)
    x = keras.ops.convert_to_tensor(X)
    if BACKEND == "jax":
        tv = [v.value for v in model.trainable_variables]
        ntv = [v.value for v in model.non_trainable_variables]

        def fn(tv, x):
            y_pred, _ = model.stateless_call(tv, ntv, x)
            return keras.ops.mean(keras.ops.square(y_pred - y))

        return fn, (tv, x)
    return (lambda x: keras.ops.mean(keras.ops.square(model(x) - y))), (x,)


# --------------------------------------------------------------------------
# 1. An empty selection: one clear ValueError
# --------------------------------------------------------------------------
@pytest.mark.parametrize("select, hint", [
    ("nothing*", r"no point that `loss_fn` ran through matched \['nothing\*'\]"),
    (["*d3"], r"no point that `loss_fn` ran through matched \['\*d3'\]"),
    (lambda point, layer: False, "the `select` callable returned False for every point"),
    (None, "no layer called `cs.sow` while `loss_fn` ran"),
])
def test_intermediate_grads_with_an_empty_selection_raises(select, hint):
    model = _model()
    fn, args = _mse_fn(model)
    with pytest.raises(ValueError, match=hint) as error:
        cs.intermediate_grads(model, fn, *args, select=select)
    message = str(error.value)
    assert message.startswith("cs.intermediate_grads differentiates the loss with respect "
                              "to the selected points, and selected none")
    assert "Use `cs.points(model, x)` to list every point" in message
    assert "Nearest points: [" in message and "d1" in message and "d2" in message
    expected = (select,) if isinstance(select, str) else tuple(select) if isinstance(
        select, list) else select
    assert message.endswith(f"Received: select={expected!r}")


def test_intermediate_grads_whose_loss_runs_no_layer_of_the_model_raises():
    model = _model()
    x = keras.ops.convert_to_tensor(X)
    with pytest.raises(ValueError, match=r"`loss_fn` ran no layer of `model`.*"
                                         r"Received: select=\('\*d1',\)"):
        cs.intermediate_grads(model, lambda x: keras.ops.sum(x ** 2), x, select="*d1")


@pytest.mark.parametrize("run_eagerly", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_grad_capture_with_an_empty_selection_raises_the_capture_error(method, run_eagerly):
    model = _model(run_eagerly=run_eagerly)
    with pytest.raises(ValueError, match=r"^cs.capture selected nothing: no point matched "
                                         r"\['nothing\*'\].*`cs.points\(model, x\)`.*"
                                         r"Received: select=\('nothing\*',\)$"):
        with cs.capture(model, "nothing*", kinds=("grad",)):
            _run(model, method)


# --------------------------------------------------------------------------
# Custom steps, per backend (JAX: callscope's in-step grads need the stock step)
# --------------------------------------------------------------------------
def _custom_step_class(losses):
    """A `cs.Sequential` whose train_step and test_step call `compute_loss`
    `losses` times: the first call is the main loss, the others add half of it."""
    class Eager(cs.Sequential):  # TF's and torch's loss and test step
        def _loss(self, x, y):
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            for _ in range(losses - 1):
                loss = loss + 0.5 * self.compute_loss(x=x, y=y, y_pred=y_pred)
            return loss

        def test_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            return {"loss": self._loss(x, y)}

    if BACKEND == "tensorflow":
        import tensorflow as tf

        class Custom(Eager):
            def train_step(self, data):
                x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
                with tf.GradientTape() as tape:
                    loss = self._loss(x, y)
                grads = tape.gradient(loss, self.trainable_weights)
                self.optimizer.apply(grads, self.trainable_weights)
                return {"loss": loss}

    elif BACKEND == "torch":
        import torch

        class Custom(Eager):
            def train_step(self, data):
                x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
                loss = self._loss(x, y)
                self.zero_grad()
                loss.backward()
                grads = [v.value.grad for v in self.trainable_weights]
                with torch.no_grad():
                    self.optimizer.apply(grads, self.trainable_weights)
                return {"loss": loss}

    else:
        import jax

        class Custom(cs.Sequential):
            def _loss(self, tv, ntv, x, y):
                y_pred, ntv = self.stateless_call(tv, ntv, x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
                for _ in range(losses - 1):
                    loss = loss + 0.5 * self.compute_loss(x=x, y=y, y_pred=y_pred)
                return loss, ntv

            def train_step(self, state, data):
                tv, ntv, ov, mv = state
                x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
                grad_fn = jax.value_and_grad(self._loss, has_aux=True)
                (loss, ntv), grads = grad_fn(tv, ntv, x, y)
                tv, ov = self.optimizer.stateless_apply(ov, grads, tv)
                return {"loss": loss}, (tv, ntv, ov, mv)

            def test_step(self, state, data):
                tv, ntv, mv = state
                x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
                loss, ntv = self._loss(tv, ntv, x, y)
                return {"loss": loss}, (tv, ntv, mv)

    return Custom


@pytest.mark.parametrize("method", METHODS)
def test_a_custom_step_that_calls_compute_loss_twice_raises(method):
    model = _model(_custom_step_class(losses=2))
    if BACKEND == "jax":  # the custom step is refused before it runs
        kind = "train" if method in ("fit", "train_on_batch") else "test"
        match = (rf"overrides `{kind}_step`. Capture the other kinds, and take d loss / "
                 r"d point inside your own stateless step with "
                 r"`cs.intermediate_grads\(model, loss_fn, ...\)`")
    else:
        match = (rf"^cs.capture\(kinds=\('grad',\)\) takes d loss / d point from the one "
                 rf"loss .*{ONE_LOSS}.*single `self.compute_loss\(...\)` call.*"
                 r"`cs.intermediate_grads\(model, loss_fn, ...\)`. Received: a second "
                 r"compute_loss call in one step$")
    with pytest.raises(ValueError, match=match):
        with cs.capture(model, "*d2", kinds=("grad",)):
            _run(model, method)
    _run(model, method)  # without a grad capture, the step runs as written


@pytest.mark.skipif(BACKEND == "jax", reason="JAX in-step grads need the stock steps")
@pytest.mark.parametrize("run_eagerly", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_a_custom_step_that_calls_compute_loss_once_gets_its_gradients(method, run_eagerly):
    model = _model(_custom_step_class(losses=1), run_eagerly=run_eagerly)
    ref = _reference(model)
    with cs.capture(model, ["*d1", "*d2"], kinds=("grad",)) as cap:
        _run(model, method)
    np.testing.assert_allclose(_one(cap, "d2:grad"), ref["d2"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_one(cap, "d1:grad"), ref["d1"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", METHODS)
def test_a_custom_step_differentiates_what_a_compute_loss_override_returns(method):
    class Tripled(_custom_step_class(losses=1)):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         training=True):
            return 3.0 * super().compute_loss(x, y, y_pred, sample_weight, training=training)

    model = _model(Tripled)
    if BACKEND == "jax":  # the custom step is refused before it runs
        kind = "train" if method in ("fit", "train_on_batch") else "test"
        with pytest.raises(ValueError, match=rf"overrides `{kind}_step`"):
            with cs.capture(model, "*d2", kinds=("grad",)):
                _run(model, method)
        return
    ref = _reference(model, scale=3.0)
    with cs.capture(model, ["*d1", "*d2"], kinds=("grad",)) as cap:
        _run(model, method)
    np.testing.assert_allclose(_one(cap, "d2:grad"), ref["d2"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_one(cap, "d1:grad"), ref["d1"], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(BACKEND == "jax", reason="JAX in-step grads need the stock steps")
def test_a_custom_step_with_an_empty_selection_raises_the_capture_error():
    model = _model(_custom_step_class(losses=1))
    with pytest.raises(ValueError, match=r"^cs.capture selected nothing"):
        with cs.capture(model, "nothing*", kinds=("grad",)):
            model.train_on_batch(X, Y)


class _Loss1p5(cs.Sequential):
    """A `compute_loss` override that calls Keras's twice: 1.5 x mse."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        main = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        extra = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return main + 0.5 * extra


@pytest.mark.parametrize("method", METHODS)
def test_the_stock_step_differentiates_the_loss_a_compute_loss_override_returns(method):
    model = _model(_Loss1p5)
    ref = _reference(model, scale=1.5)
    with cs.capture(model, ["*d1", "*d2"], kinds=("grad",)) as cap:
        _run(model, method)
    np.testing.assert_allclose(_one(cap, "d2:grad"), ref["d2"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_one(cap, "d1:grad"), ref["d1"], rtol=1e-5, atol=1e-7)


def test_intermediate_grads_differentiates_the_total_of_several_compute_loss_calls():
    """The way out the error names: `cs.intermediate_grads` inside the step."""
    model = _model()
    x, y = keras.ops.convert_to_tensor(X), keras.ops.convert_to_tensor(Y)
    ref = _reference(model, scale=1.5)
    if BACKEND == "jax":
        import jax

        ntv = [v.value for v in model.non_trainable_variables]

        def fn(tv, x):
            y_pred, _ = model.stateless_call(tv, ntv, x)
            main = model.compute_loss(x=x, y=y, y_pred=y_pred)
            return main + 0.5 * model.compute_loss(x=x, y=y, y_pred=y_pred)

        @jax.jit  # as inside a compiled train_step
        def step(tv, x):
            result = cs.intermediate_grads(model, fn, tv, x, select=["*d1", "*d2"])
            return result.loss, result.grads

        loss, grads = step([v.value for v in model.trainable_variables], x)
    else:
        def fn(x):
            y_pred = model(x, training=True)
            main = model.compute_loss(x=x, y=y, y_pred=y_pred)
            return main + 0.5 * model.compute_loss(x=x, y=y, y_pred=y_pred)

        result = cs.intermediate_grads(model, fn, x, select=["*d1", "*d2"])
        loss, grads = result.loss, result.grads
    assert float(numpy(loss)) == pytest.approx(ref["loss"], rel=1e-5)
    np.testing.assert_allclose(_one(grads, "d2:grad"), ref["d2"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_one(grads, "d1:grad"), ref["d1"], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------
# Sources that are one tensor, and a constant source
# --------------------------------------------------------------------------
class Scale(keras.layers.Layer):
    """Multiplies by a constant that it sows."""

    def call(self, x):
        return x * cs.sow(self, "c", keras.ops.convert_to_tensor(2.0))


def _residual():
    """d1 -> Identity -> + d2(d1): `ident` returns the very tensor d1 made."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(2, name="d1")(inputs)
    i = keras.layers.Identity(name="ident")(Scale(name="scale")(h))
    out = keras.layers.Add(name="add")([i, keras.layers.Dense(2, name="d2")(h)])
    model = cs.Model(inputs, out, name="r")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def _residual_reference(model, y):
    w1, b1 = _weights(model, "d1")
    w2, b2 = _weights(model, "d2")
    h = X @ w1 + b1
    out = 2.0 * h + h @ w2 + b2
    d_out = 2 * (out - y) / out.size
    return {"ident": d_out, "scale": d_out, "c": np.sum(d_out * h),
            "d1": 2.0 * d_out + d_out @ w2.T}


@pytest.mark.parametrize("how", ["train_on_batch", "intermediate_grads"])
def test_a_layer_that_returns_its_input_is_a_source_of_its_own(how):
    model = _residual()
    y = rng.normal(size=(5, 2)).astype("float32")
    ref = _residual_reference(model, y)
    select = ["*d1", "*ident", "*scale", "*scale/c"]
    if how == "train_on_batch":
        with cs.capture(model, select, kinds=("grad",)) as cap:
            model.train_on_batch(X, y)
        grads = {key: cap[key] for key in cap}
    else:
        fn, args = _mse_fn(model, y)
        grads = cs.intermediate_grads(model, fn, *args, select=select).grads
    for name in ("d1", "ident", "scale"):
        np.testing.assert_allclose(_one(grads, f"{name}:grad"), ref[name], rtol=1e-5,
                                   atol=1e-7, err_msg=name)
    assert float(_one(grads, "c:grad").reshape(())) == pytest.approx(ref["c"], rel=1e-5)


# --------------------------------------------------------------------------
# 3. `loss_fn` runs once per `cs.intermediate_grads`
# --------------------------------------------------------------------------
def _counted(fn):
    calls = []

    def counted(*args):
        calls.append(1)
        return fn(*args)

    return counted, calls


def test_intermediate_grads_runs_loss_fn_once_per_call():
    model = _model()
    fn, args = _mse_fn(model)
    counted, calls = _counted(fn)
    ref = _reference(model)
    for n in range(1, 4):
        result = cs.intermediate_grads(model, counted, *args, select=["*d1", "*d2"])
        assert len(calls) == n
    assert float(numpy(result.loss)) == pytest.approx(ref["loss"], rel=1e-5)
    np.testing.assert_allclose(_one(result.grads, "d2:grad"), ref["d2"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_one(result.grads, "d1:grad"), ref["d1"], rtol=1e-5, atol=1e-7)


def _jax_hand_written(model):
    """d mse / d (d1 output), d (d2 output) by jax.grad of the written-out model."""
    import jax
    import jax.numpy as jnp

    w1, b1 = _weights(model, "d1")
    w2, b2 = _weights(model, "d2")
    h = jnp.asarray(X) @ w1 + b1
    out = h @ w2 + b2
    from_out = lambda o: jnp.mean((o - Y) ** 2)  # noqa: E731
    return {"d1": jax.grad(lambda h: from_out(h @ w2 + b2))(h), "d2": jax.grad(from_out)(out),
            "out": out}


@pytest.mark.skipif(BACKEND != "jax", reason="the one-trace path is JAX's")
@pytest.mark.parametrize("compiled", [False, True])
def test_jax_intermediate_grads_traces_loss_fn_once(compiled):
    import jax

    model = _model()
    _, args = _mse_fn(model)
    y = keras.ops.convert_to_tensor(Y)

    def loss_fn(tv, x):  # returns (loss, aux)
        calls.append(1)
        y_pred, _ = model.stateless_call(tv, [], x)
        return keras.ops.mean(keras.ops.square(y_pred - y)), y_pred

    calls = []

    def grads_of(tv, x):
        result = cs.intermediate_grads(model, loss_fn, tv, x, select=["*d1", "*d2"])
        return result.grads, result.outputs, result.aux

    run = jax.jit(grads_of) if compiled else grads_of
    for n in range(1, 4):
        grads, outputs, aux = run(*args)
        assert len(calls) == (1 if compiled else n)  # jit: one trace, then the cache
    ref = _jax_hand_written(model)
    np.testing.assert_allclose(_one(grads, "d1:grad"), ref["d1"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_one(grads, "d2:grad"), ref["d2"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(numpy(aux), ref["out"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_one(outputs, "d2:output"), ref["out"], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(BACKEND != "jax", reason="the one-trace path is JAX's")
def test_jax_intermediate_grads_falls_back_to_a_second_run(monkeypatch):
    from callscope._grads import jax as jax_grads

    monkeypatch.setattr(jax_grads, "_as_inputs", lambda closed, kept: None)
    model = _model()
    fn, args = _mse_fn(model)
    counted, calls = _counted(fn)
    result = cs.intermediate_grads(model, counted, *args, select=["*d1", "*d2"])
    assert len(calls) == 2
    ref = _jax_hand_written(model)
    np.testing.assert_allclose(_one(result.grads, "d1:grad"), ref["d1"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_one(result.grads, "d2:grad"), ref["d2"], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------
# 4. Gradients the step's own backward pass does not give (TF and torch take
#    the others from it): a weightless or frozen prefix, and a gradient a layer
#    takes inside its own forward pass
# --------------------------------------------------------------------------
def _prefixed():
    """Rescaling (no weights) -> frozen Dense -> Dense -> Dense: the step's backward
    reaches the last two outputs only, as no trainable weight comes before the
    first two."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.Rescaling(2.0, name="pre")(inputs)
    frozen = keras.layers.Dense(4, name="frozen")
    frozen.trainable = False
    h = keras.layers.Dense(3, name="d2")(frozen(h))
    model = cs.Model(inputs, keras.layers.Dense(1, name="d3")(h), name="p")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def _prefixed_reference(model):
    w1, b1 = _weights(model, "frozen")
    w2, b2 = _weights(model, "d2")
    w3, b3 = _weights(model, "d3")
    out = ((2.0 * X @ w1 + b1) @ w2 + b2) @ w3 + b3
    d3 = 2 * (out - Y) / out.size
    d2 = d3 @ w3.T
    frozen = d2 @ w2.T
    return {"d3": d3, "d2": d2, "frozen": frozen, "pre": frozen @ w1.T}


@pytest.mark.parametrize("method", ["fit", "train_on_batch"])
def test_sources_before_every_trainable_weight_get_their_gradients(method):
    model = _prefixed()
    ref = _prefixed_reference(model)
    with cs.capture(model, ["*pre", "*frozen", "*d2", "*d3"], kinds=("grad",)) as cap:
        _run(model, method)
    for name, expected in ref.items():
        assert np.abs(expected).max() > 1e-3, name  # a zero would pass unnoticed
        np.testing.assert_allclose(_one(cap, f"{name}:grad"), expected, rtol=1e-5,
                                   atol=1e-7, err_msg=name)


def _outer_gradients_per_trace(monkeypatch):
    """Counts `tape.gradient` calls on persistent tapes (callscope's outer tape;
    Keras's own step tape is not persistent)."""
    import tensorflow as tf

    calls = []
    gradient = tf.GradientTape.gradient

    def counted(tape, *args, **kwargs):
        calls.append(tape._persistent)
        return gradient(tape, *args, **kwargs)

    monkeypatch.setattr(tf.GradientTape, "gradient", counted)
    return calls


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's outer tape")
@pytest.mark.parametrize("select, outer", [
    (["*d2", "*d3"], 0),  # all from the step's own backward: no second pass
    (["*pre", "*d3"], 1),  # `pre` is before every trainable weight
])
def test_tensorflow_takes_a_second_backward_only_where_the_step_has_none(
        monkeypatch, select, outer):
    model = _prefixed()
    ref = _prefixed_reference(model)
    calls = _outer_gradients_per_trace(monkeypatch)
    with cs.capture(model, select, kinds=("grad",)) as cap:
        model.fit(X, Y, batch_size=len(X), epochs=2, shuffle=False, verbose=0)
    assert calls == [False] + [True] * outer  # traced once: Keras's backward (+ ours)
    for pattern in select:
        name = pattern[1:]
        np.testing.assert_allclose(_one(cap, f"{name}:grad")[:len(X)], ref[name],
                                   rtol=1e-5, atol=1e-7, err_msg=name)


class _SmoothnessPenalty(keras.layers.Layer):
    """Adds a penalty on d sum(h^2) / d x, taken inside the forward pass, where
    h is the output of a frozen inner Dense: that gradient passes through h's
    source before the loss exists, and the step's own backward never reaches h."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3, name="inner")
        self.inner.trainable = False

    def call(self, x):
        if BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                tape.watch(x)
                h = self.inner(x)
                s = tf.reduce_sum(h * h)
            g = tape.gradient(s, x)
        else:
            import torch

            if x.device.type == "meta":  # Keras's shape inference: no autograd there
                return self.inner(x)
            with torch.enable_grad():
                x = x.detach().requires_grad_()
                h = self.inner(x)
                (g,) = torch.autograd.grad(torch.sum(h * h), x, create_graph=True)
        return h + keras.ops.sum(g * g, axis=-1, keepdims=True)


@pytest.mark.skipif(BACKEND == "jax", reason="JAX takes no gradient through hooks: its "
                    "sources are perturbations differentiated by value_and_grad")
def test_a_gradient_taken_inside_the_forward_pass_is_not_the_captured_one():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    penalty = _SmoothnessPenalty(name="pen")
    model = cs.Model(inputs, keras.layers.Dense(1, name="d2")(penalty(inputs)), name="s")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    with cs.capture(model, ["*pen/inner"], kinds=("grad",)) as cap:
        model.train_on_batch(X, Y)
    w1, b1 = (numpy(v) for v in penalty.inner.weights)
    w2, b2 = _weights(model, "d2")
    h = X @ w1 + b1
    g = 2 * h @ w1.T  # d sum(h^2) / d x
    out = (h + np.sum(g * g, axis=-1, keepdims=True)) @ w2 + b2
    # d loss / d h: through `h +` directly, and through the penalty's g = 2 h w1^T.
    d_out = 2 * (out - Y) / out.size
    d_sum = d_out @ w2.T
    direct = d_sum
    via_penalty = np.sum(d_sum, axis=-1, keepdims=True) * 2 * g @ w1 * 2
    np.testing.assert_allclose(_one(cap, "inner:grad"), direct + via_penalty, rtol=1e-4,
                               atol=1e-6)


# --------------------------------------------------------------------------
# 5. A checkpoint a layer makes inside its own call (`keras.remat`, the backend's
#    own): its body is a loop body on every backend, never a silently wrong point
#    (TF's gradients of values inside `tf.recompute_grad` read 0, JAX's body is a
#    trace of its own)
# --------------------------------------------------------------------------
def _backend_checkpoint(f):
    if BACKEND == "jax":
        import jax

        return jax.checkpoint(f)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.recompute_grad(f)
    import torch  # its own checkpoint computes it right: see the test

    return lambda *args: torch.utils.checkpoint.checkpoint(f, *args, use_reentrant=False)


class _Checkpointed(keras.layers.Layer):
    def __init__(self, how="keras", **kwargs):
        super().__init__(**kwargs)
        self.how = how
        self.d1 = keras.layers.Dense(4, name="d1")
        self.d2 = keras.layers.Dense(4, name="d2")

    def call(self, x):
        body = lambda t: self.d2(self.d1(t))  # noqa: E731
        if self.how is None:
            return body(x)
        return (keras.remat(body) if self.how == "keras" else _backend_checkpoint(body))(x)


def _checkpointed(how, layer=None, learning_rate=0.0):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = (layer or _Checkpointed)(how, name="inner")(inputs)
    model = cs.Model(inputs, keras.layers.Dense(1, name="head")(h), name="c")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    return model


@pytest.mark.parametrize("how", ["keras", "backend"])
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_points_inside_a_checkpoint_are_loop_points(how, run_eagerly):
    model = _checkpointed(how)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", run_eagerly=run_eagerly)
    with cs.capture(model, "*", kinds=("output", "grad")) as cap:
        model.fit(X, Y, batch_size=len(X), epochs=1, shuffle=False, verbose=0)
    # Without the checkpoint the same weights give every point; with it, the
    # layer that makes the checkpoint is the point (a glob leaves its body out).
    plain = _checkpointed(None)
    plain.set_weights(model.get_weights())
    with cs.capture(plain, "*", kinds=("output", "grad")) as ref:
        plain.fit(X, Y, batch_size=len(X), epochs=1, shuffle=False, verbose=0)
    inside = {k for k in ref.keys() if "/inner/" in k}
    assert inside == {"c/inner/d1:output", "c/inner/d1:grad", "c/inner/d2:output",
                      "c/inner/d2:grad"}
    if how == "backend" and BACKEND == "torch":  # torch's checkpoint: right, and kept
        assert set(cap.keys()) == set(ref.keys())
    else:
        assert set(cap.keys()) == set(ref.keys()) - inside
    for key in cap.keys():
        np.testing.assert_allclose(numpy(cap[key]), numpy(ref[key]), rtol=1e-5, atol=1e-7,
                                   err_msg=key)
    assert np.abs(numpy(cap["c/inner:grad"])).max() > 1e-3
    if how == "backend" and BACKEND == "torch":
        return
    # Named exactly, a point inside raises, saying what to capture instead.
    with pytest.raises(cs.LoopPointError, match=r"checkpoint: keras.remat.*Capture or patch "
                       r"`c/inner` instead"):
        with cs.capture(model, ["c/inner/d1"], kinds=("grad",)):
            model.fit(X, Y, batch_size=len(X), epochs=1, shuffle=False, verbose=0)
    # The body's layers are not noted as points of their own when a backward pass
    # runs it again (TF's `recompute_grad`, torch's checkpoint): error messages
    # list the model's points only.
    if how == "keras":
        assert "d1" not in model._cs_known_points()


class _CustomGradient(keras.layers.Layer):
    """Doubles its input through `keras.ops.custom_gradient` (the true gradient)
    and sows the doubled value inside; `custom=False`: the same without it."""

    def __init__(self, custom=True, **kwargs):
        super().__init__(**kwargs)
        self.custom = custom

    def call(self, x):
        def body(t):
            return cs.sow(self, "doubled", t * 2.0)

        if not self.custom:
            return body(x) + 0.0

        @keras.ops.custom_gradient
        def doubled(t):
            def grad(*args, upstream=None):
                return (args[0] if upstream is None else upstream) * 2.0

            return body(t), grad

        return doubled(x) + 0.0


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_value_sown_inside_a_custom_gradient_function_is_a_loop_point(run_eagerly):
    """A value made inside `keras.ops.custom_gradient`'s function: TF's compiled
    step read its gradient as 0 (the override cuts the path), torch raised its own
    error (it runs the function without gradients), JAX refused it in fit but
    captured it in a direct call. Now a loop point everywhere: a glob leaves it
    out, the rest equal the model without the custom gradient, and naming it
    raises."""
    weights = None
    caps = {}
    for custom in (True, False):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        h = _CustomGradient(custom, name="cg")(keras.layers.Dense(3, name="d")(inputs))
        model = cs.Model(inputs, keras.layers.Dense(1, name="head")(h), name="m")
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", run_eagerly=run_eagerly)
        if weights is None:
            weights = model.get_weights()
        model.set_weights(weights)
        with cs.capture(model, "*", kinds=("output", "grad")) as caps[custom]:
            model.fit(X, Y, batch_size=len(X), epochs=1, shuffle=False, verbose=0)
        if custom:
            with pytest.raises(cs.LoopPointError, match=r"keras.ops.custom_gradient.*"
                               r"Capture or patch `m/cg` instead"):
                with cs.capture(model, ["m/cg/doubled"], kinds=("grad",)):
                    model.fit(X, Y, batch_size=len(X), epochs=1, shuffle=False, verbose=0)
            with pytest.raises(cs.LoopPointError, match="custom_gradient"):
                with cs.capture(model, ["m/cg/doubled"]):
                    model(X)
    inside = {"m/cg/doubled:output", "m/cg/doubled:grad"}
    assert inside <= set(caps[False].keys())
    assert set(caps[True].keys()) == set(caps[False].keys()) - inside
    for key in caps[True].keys():
        np.testing.assert_allclose(numpy(caps[True][key]), numpy(caps[False][key]),
                                   rtol=1e-5, atol=1e-7, err_msg=key)
    assert np.abs(numpy(caps[True]["m/cg:grad"])).max() > 1e-3


class _SowingCheckpointed(_Checkpointed):
    """The body's first layer sows a value, and the body's output is a tuple."""

    def call(self, x):
        def body(t):
            h = self.d1(t)
            return cs.sow(self.d1, "twice", h * 2.0), self.d2(h)

        if self.how is None:
            first, second = body(x)
        else:
            first, second = _backend_checkpoint(body)(x)
        return first + second


@pytest.mark.skipif(BACKEND != "torch", reason="torch's own checkpoint keeps its points")
@pytest.mark.parametrize("how_run", ["fit", "train_on_batch", "custom_loop"])
def test_a_patch_inside_a_torch_checkpoint_applies_to_its_recompute_too(how_run):
    """torch runs a checkpoint's function again in the backward pass, each layer
    on its own: the patches applied in the forward pass apply there again, or
    the gradients are those of the unpatched model. Against the same model
    without the checkpoint, same weights and patches: the same updates."""
    import torch

    def build(how):
        return _checkpointed(how, _SowingCheckpointed, learning_rate=0.1)

    patches = {"c/inner/d1": lambda v: v * 3.0 + 1.0, "c/inner/d1/twice": lambda v: -v}
    if how_run == "train_on_batch":  # (only there does a patch get the batch)
        patches["c/inner/d2"] = lambda v, batch: v + keras.ops.cast(batch.rows, v.dtype)
    weights = {}
    for how in (None, "backend"):
        model = build(how)
        with cs.patch(model, patches):
            if how_run == "fit":
                model.fit(X, Y, batch_size=len(X), epochs=2, shuffle=False, verbose=0)
            elif how_run == "train_on_batch":
                model.train_on_batch(X, Y)
                model.train_on_batch(X, Y)
            else:  # a custom loop: the backward pass runs after the call returned
                loss = ((model(torch.as_tensor(X)) - torch.as_tensor(Y)) ** 2).mean()
        if how_run == "custom_loop":
            loss.backward()
            weights[how] = [w.value.grad.numpy().copy() for w in model.trainable_weights]
        else:
            weights[how] = [numpy(w) for w in model.get_weights()]
        assert "d1" not in model._cs_known_points()
    moved = [np.abs(a - w).max() for a, w in zip(weights[None], build(None).get_weights())]
    assert how_run == "custom_loop" or min(moved) > 1e-4  # every weight was updated
    for a, b in zip(weights[None], weights["backend"]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# 6. Points whose value is not floating point (an argmax, a mask): no gradient.
#    A glob leaves them out of `grad` (their other kinds record), alike on every
#    backend; naming one exactly raises
# --------------------------------------------------------------------------
class _WithIds(keras.layers.Layer):
    """A float element `h`, an int element `ids` and a sown bool `mask`."""

    def call(self, x):
        cs.sow(self, "mask", x > 0)
        return {"h": x * 2.0, "ids": keras.ops.argmax(x, axis=-1)}


class _IdsNet(cs.Model):
    def __init__(self):
        super().__init__(name="net")
        self.a = _WithIds(name="a")
        self.d = keras.layers.Dense(1, name="d")

    def call(self, x):
        return self.d(self.a(x)["h"])


def _ids_net(run_eagerly=False):
    keras.utils.set_random_seed(0)
    model = _IdsNet()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", run_eagerly=run_eagerly)
    model(X[:1])
    return model


def _ids_reference(model):
    """d mse / d `net/a/h` and d `net/d` (the model's output), by hand (numpy)."""
    w, b = _weights(model, "d")
    out = (2.0 * X) @ w + b
    d_out = 2 * (out - Y) / out.size
    return {"net/a/h": d_out @ w.T, "net/d": d_out, "net": d_out}


_FLOAT_KEYS = ["net/a/h:grad", "net/d:grad", "net:grad"]
_ALL_OUTPUTS = ["net/a/h:output", "net/a/ids:output", "net/a/mask:output", "net/d:output",
                "net:output"]


@pytest.mark.parametrize("run_eagerly", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_a_glob_leaves_points_that_are_not_floating_point_out_of_grad(method, run_eagerly):
    model = _ids_net(run_eagerly)
    ref = _ids_reference(model)
    with cs.capture(model, "*", kinds=("output", "grad")) as cap:
        _run(model, method)
    assert sorted(cap) == sorted([*_ALL_OUTPUTS, *_FLOAT_KEYS])  # no ids:grad, mask:grad
    for key in _FLOAT_KEYS:
        np.testing.assert_allclose(numpy(cap[key]), ref[key.partition(":")[0]],
                                   rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(numpy(cap["net/a/ids:output"]), X.argmax(-1))
    np.testing.assert_array_equal(numpy(cap["net/a/mask:output"]), X > 0)


@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_a_reduced_glob_gradient_capture_leaves_them_out_too(method):
    model = _ids_net()
    ref = _ids_reference(model)
    with cs.capture(model, "*", kinds=("grad",), reduce=("rms", "max")) as cap:
        _run(model, method)
    assert sorted(cap) == sorted(f"{k}/{s}" for k in _FLOAT_KEYS for s in ("max", "rms"))
    for key in _FLOAT_KEYS:
        g = ref[key.partition(":")[0]]
        np.testing.assert_allclose(numpy(cap[key + "/rms"]).reshape(-1)[0],
                                   np.sqrt(np.mean(g ** 2)), rtol=1e-5)
        np.testing.assert_allclose(numpy(cap[key + "/max"]).reshape(-1)[0], g.max(),
                                   rtol=1e-5)


def test_intermediate_grads_with_a_glob_leaves_them_out_too():
    model = _ids_net()
    ref = _ids_reference(model)
    fn, args = _mse_fn(model)
    result = cs.intermediate_grads(model, fn, *args, select="*")
    assert sorted(result.grads) == sorted(_FLOAT_KEYS)
    assert sorted(result.outputs) == sorted(_ALL_OUTPUTS)
    for key in _FLOAT_KEYS:
        np.testing.assert_allclose(numpy(result.grads[key]), ref[key.partition(":")[0]],
                                   rtol=1e-5, atol=1e-7)


class _SowsIds(keras.layers.Layer):
    """Sows its int element `ids` (one point with the element) and its float `h`."""

    def call(self, x):
        return {"h": x * 2.0, "ids": cs.sow(self, "ids", keras.ops.argmax(x, axis=-1))}


class _SownIdsNet(_IdsNet):
    def __init__(self):
        super().__init__()
        self.a = _SowsIds(name="a")


@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_a_sown_element_that_is_not_floating_point_takes_no_grad_of_the_layer(method):
    """Selecting the layer selects its elements: the sown int one has no gradient,
    so no conflict with the sown point's own (unselected) gradient either."""
    keras.utils.set_random_seed(0)
    model = _SownIdsNet()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model(X[:1])
    ref = _ids_reference(model)
    with cs.capture(model, "net/a", kinds=("output", "grad")) as cap:
        _run(model, method)
    assert sorted(cap) == ["net/a/h:grad", "net/a/h:output", "net/a/ids:output"]
    np.testing.assert_allclose(numpy(cap["net/a/h:grad"]), ref["net/a/h"], rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_array_equal(numpy(cap["net/a/ids:output"]), X.argmax(-1))


def _not_floating(point, dtype):
    return (rf"d loss / d `{point}` is not defined: a gradient is taken only at a "
            rf"floating-point value, and the value of `{point}` is {dtype}\. Take "
            r"gradients at floating-point points only \(a glob such as `\*` leaves "
            r"points whose values are not floating point out of `grad`, and records "
            rf"their other kinds\), or capture `{point}` with kinds=\('output',\)\. "
            rf"Received: select='{point}' with kinds including 'grad', at a value of "
            rf"dtype {dtype}")


@pytest.mark.parametrize("select, point, dtype", [
    ("net/a/ids", "net/a/ids", "int(32|64)"),
    ("net/a/mask", "net/a/mask", "bool"),
    (["*d", "net/a/ids"], "net/a/ids", "int(32|64)"),
])
@pytest.mark.parametrize("run_eagerly", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_grad_of_a_point_named_exactly_that_is_not_floating_point_raises(
        method, run_eagerly, select, point, dtype):
    model = _ids_net(run_eagerly)
    with pytest.raises(ValueError, match=_not_floating(point, dtype)):
        with cs.capture(model, select, kinds=("output", "grad")):
            _run(model, method)


@pytest.mark.parametrize("point, dtype", [("net/a/ids", "int(32|64)"), ("net/a/mask", "bool")])
def test_intermediate_grads_of_a_point_named_exactly_that_is_not_floating_point_raises(
        point, dtype):
    model = _ids_net()
    fn, args = _mse_fn(model)
    with pytest.raises(ValueError, match=_not_floating(point, dtype)):
        cs.intermediate_grads(model, fn, *args, select=["*d", point])


# --------------------------------------------------------------------------
# 7. A point that matched but has none of the kinds asked for: said so, with the
#    kinds it has (not "no point matched")
# --------------------------------------------------------------------------
class _SowingBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return keras.ops.relu(cs.sow(self, "pre", self.dense(x)))


def _no_kind(points, parts, kinds, select):
    listed = ", ".join(f"'{p}'" for p in points)
    return (
        rf"^cs\.capture selected nothing: \[{listed}\] matched, but "
        rf"{'it has no kind' if len(points) == 1 else 'none of them has a kind'} in "
        rf"kinds=\({kinds}\): {parts}\. `input` is what a layer's call receives; `grad` "
        r"\(d loss / d point, in fit, evaluate and the \*_on_batch methods\) is taken "
        r"only where the value is floating point\. Ask for kinds the points have, or "
        r"select points that have the kinds asked for\. Received: "
        rf"select=\({select}\), kinds=\({kinds}\)$"
    )


def test_a_sown_point_asked_for_its_input_says_it_has_only_output():
    model = cs.Sequential([keras.Input((4,)), _SowingBlock(name="b0")], name="seq")
    with pytest.raises(ValueError, match=_no_kind(
            ["seq/b0/pre"], r"`seq/b0/pre` is a sown value, which has only `output` "
            r"\(and `grad`\)", "'input',", "'seq/b0/pre',")):
        with cs.capture(model, "seq/b0/pre", kinds=("input",)):
            model.predict(np.ones((2, 4), "float32"), verbose=0)


def test_points_asked_for_kinds_they_lack_are_named_with_the_kinds_they_have():
    model = _ids_net()
    with pytest.raises(ValueError, match=_no_kind(
            ["net/a/mask", "net/a/ids"],  # in call order: sown inside `a`'s call
            r"`net/a/mask` is a sown value, which has only `output` \(and `grad`\); "
            r"`net/a/ids` is an element of a layer's output, which has only `output` "
            r"\(and `grad`\)", "'input',", "'net/a/ids', 'net/a/mask'")):
        with cs.capture(model, ["net/a/ids", "net/a/mask"], kinds=("input",)):
            model.predict(X, verbose=0)
    # A glob that matches only points that are not floating point, for `grad`.
    with pytest.raises(ValueError, match=_no_kind(
            ["net/a/ids"], r"`net/a/ids` is an element of a layer's output, which has "
            r"only `output` \(and `grad`\)", "'grad',", r"'net/a/id\*',")):
        with cs.capture(model, "net/a/id*", kinds=("grad",)):
            model.evaluate(X, Y, verbose=0)


class _SowsItsKernel(keras.layers.Layer):
    """x @ kernel + bias, with the kernel sown as it is (`copy=False`: the variable)
    or as a tensor the layer computes with (`copy=True`)."""

    def __init__(self, copy, **kwargs):
        super().__init__(**kwargs)
        self.copy = copy
        self.dense = keras.layers.Dense(1, name="dense")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        kernel = self.dense.kernel * 1.0 if self.copy else self.dense.kernel
        kernel = cs.sow(self, "kernel", kernel)
        return keras.ops.matmul(x, kernel) + self.dense.bias


def test_a_variable_sown_as_it_is_has_no_gradient_of_its_own():
    # It raised inside JAX's and torch's autodiff, and TF gave the weight's gradient.
    model = cs.Sequential([keras.Input((3,)), _SowsItsKernel(False, name="k")], name="m")
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"d loss / d `m/k/kernel` is not taken: `m/k/kernel` is "
                       r"a variable sown as it is \('m/k/dense/kernel'\).*self.kernel \* 1.0.*"
                       r"Received: select='m/k/kernel' with kinds including 'grad'"):
        with cs.capture(model, "m/k/kernel", kinds=("output", "grad")):
            model.train_on_batch(X, Y)
    with cs.capture(model, "*", kinds=("output", "grad")) as cap:  # a glob leaves it out
        model.train_on_batch(X, Y)
    assert "m/k/kernel:output" in cap and "m/k/kernel:grad" not in cap
    # The value the layer computes with has one: d mse / d kernel.
    model = cs.Sequential([keras.Input((3,)), _SowsItsKernel(True, name="k")], name="m")
    model.compile(optimizer="sgd", loss="mse")
    kernel, bias = (numpy(w) for w in model.get_layer("k").dense.weights)
    with cs.capture(model, "m/k/kernel", kinds=("output", "grad")) as cap:
        model.train_on_batch(X, Y)
    out = X @ kernel + bias
    np.testing.assert_allclose(cap["m/k/kernel:grad"], X.T @ (2 * (out - Y) / len(X)),
                               rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------
# 7. What `loss_fn` may be, alike on every backend
# --------------------------------------------------------------------------
@pytest.mark.parametrize("returns, message", [
    (lambda loss, out: keras.ops.subtract(out, Y), "differentiates a scalar loss"),  # TF: sum
    (lambda loss, out: (loss,), "a tuple of length 1"),         # TF/torch: IndexError
    (lambda loss, out: [loss, out], "a list of length 2"),
    (lambda loss, out: (loss, out, out), "a tuple of length 3"),
    (lambda loss, out: np.float32(1.0), "Received: loss=float32"),  # raw AttributeError
])
def test_intermediate_grads_refuses_a_loss_fn_that_returns_no_scalar_loss(returns, message):
    model = _model()
    fn, args = _mse_fn(model)

    def returning(*args):
        out = model(X) if BACKEND != "jax" else model.stateless_call(
            args[0], [v.value for v in model.non_trainable_variables], args[1])[0]
        return returns(fn(*args), out)

    with pytest.raises(ValueError, match=message):
        cs.intermediate_grads(model, returning, *args, select="*d1")
    result = cs.intermediate_grads(model, lambda *a: (fn(*a), 7), *args, select="*d1")
    assert result.aux == 7
    np.testing.assert_allclose(_one(result.grads, "d1:grad"), _reference(model)["d1"],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.vmap and jax.jit around the model")
@pytest.mark.parametrize("around", ["vmap", "jit", "jit_traced_before"])
def test_jax_intermediate_grads_refuses_a_model_run_inside_a_transformation(around):
    """A model called under jax.vmap (per-example gradients) recorded a (1, 4)
    gradient summed over the examples and leaked its tracers; under a jax.jit,
    every gradient read 0 (JAX reused the jit's trace in the second run)."""
    import jax

    model = _model()
    fn, (tv, x) = _mse_fn(model)
    ntv = [v.value for v in model.non_trainable_variables]
    if around == "vmap":
        def loss_fn(tv, x):
            per_row = jax.vmap(lambda row: model.stateless_call(tv, ntv, row[None])[0][0])(x)
            return keras.ops.mean(keras.ops.square(per_row - Y))
    else:
        loss_fn = jax.jit(fn)
        if around == "jit_traced_before":
            loss_fn(tv, x)
    if around == "jit_traced_before":  # JAX runs none of the model's Python
        with pytest.raises(ValueError, match="not inside a jax.vmap, a loop, or a jax.jit"):
            cs.intermediate_grads(model, loss_fn, tv, x, select="m/d1")
    else:
        with pytest.raises(cs.LoopPointError, match="jax.vmap, jax.jit or jax.checkpoint"):
            cs.intermediate_grads(model, loss_fn, tv, x, select="m/d1")
        with pytest.raises(ValueError, match="only inside a loop body or a transformation"):
            cs.intermediate_grads(model, loss_fn, tv, x, select="*")  # a glob: left out
    # Called directly, the same loss is differentiated.
    result = cs.intermediate_grads(model, fn, tv, x, select="*d1")
    np.testing.assert_allclose(_one(result.grads, "d1:grad"), _reference(model)["d1"],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.no_grad")
def test_torch_intermediate_grads_works_inside_no_grad():
    import torch

    model = _model()
    fn, args = _mse_fn(model)
    with torch.no_grad():  # an evaluation loop
        result = cs.intermediate_grads(model, fn, *args, select="*d1")
    np.testing.assert_allclose(_one(result.grads, "d1:grad"), _reference(model)["d1"],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ["evaluate", "test_on_batch"])
def test_a_loss_that_depends_on_no_selected_point_of_a_frozen_model_reads_zeros(method):
    """torch raised its own "does not require grad" error where the loss had no
    graph (no trainable weight, no selected point on its path)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = cs.Model(inputs, {"a": keras.layers.Dense(1, name="a")(inputs),
                              "b": keras.layers.Dense(1, name="b")(inputs)}, name="m")
    model.trainable = False
    model.compile(optimizer="sgd", loss={"a": "mse", "b": None})
    with cs.capture(model, ["m/a", "m/b"], kinds=("grad",)) as grads:
        if method == "evaluate":
            model.evaluate(X, {"a": Y, "b": Y}, batch_size=len(X), verbose=0)
        else:
            model.test_on_batch(X, {"a": Y, "b": Y})
    np.testing.assert_array_equal(grads["m/b:grad"], np.zeros((len(X), 1), "float32"))
    w, b = _weights(model, "a")
    np.testing.assert_allclose(grads["m/a:grad"], 2 * (X @ w + b - Y) / len(X),
                               rtol=1e-5, atol=1e-7)
    with cs.capture(model, ["m/b"], kinds=("grad",)) as only_b:
        model.test_on_batch(X, {"a": Y, "b": Y})
    np.testing.assert_array_equal(only_b["m/b:grad"], np.zeros((len(X), 1), "float32"))


@pytest.mark.skipif(BACKEND == "jax", reason="JAX refuses custom train_steps with grads")
def test_a_custom_step_that_runs_the_model_after_its_loss_gives_each_run_a_gradient():
    """torch filed the gradients at the loss and dropped the later run's sources:
    `net/d1:grad` beside `net/d1@0:output` and `net/d1@1:output`."""

    class Twice(cs.Sequential):
        def train_step(self, *args):
            x, y = args[0][:2] if isinstance(args[0], tuple) else args[:2]
            if BACKEND == "tensorflow":
                import tensorflow as tf

                with tf.GradientTape() as tape:
                    loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
                self.optimizer.apply_gradients(
                    zip(tape.gradient(loss, self.trainable_variables),
                        self.trainable_variables))
            else:
                self.zero_grad()
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
                loss.backward()
                self.optimizer.apply([v.value.grad for v in self.trainable_variables],
                                     self.trainable_variables)
            self(x)  # again, after the loss: for a metric, say
            return {"loss": loss}

    model = _model(Twice)
    with cs.capture(model, "m/d1", kinds=("output", "grad")) as cap:
        model.train_on_batch(X, Y)
    assert sorted(cap) == ["m/d1@0:grad", "m/d1@0:output", "m/d1@1:grad", "m/d1@1:output"]
    np.testing.assert_allclose(cap["m/d1@0:grad"], _reference(model)["d1"], rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_array_equal(cap["m/d1@1:grad"], np.zeros((len(X), 4), "float32"))


@pytest.mark.skipif(BACKEND != "torch", reason="torch.inference_mode")
def test_torch_intermediate_grads_refuses_inference_mode():
    """enable_grad cannot undo inference_mode: every gradient read 0."""
    import torch

    model = _model()
    fn, args = _mse_fn(model)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="cannot differentiate inside "
                                               "torch.inference_mode()"):
            cs.intermediate_grads(model, fn, *args, select="*d1")


# --------------------------------------------------------------------------
# cs.intermediate_grads under the caller's scopes, outside any step
# --------------------------------------------------------------------------
def test_intermediate_grads_applies_an_open_patch_scope():
    """The model's calls in `loss_fn` see a collector, as a step's do: they once
    skipped the caller's cs.patch scope, and the loss and gradients were the
    unpatched model's."""
    model = _model()
    fn, args = _mse_fn(model)
    w1, b1 = _weights(model, "d1")
    w2, b2 = _weights(model, "d2")
    h = 2.0 * (X @ w1 + b1)  # the patched d1
    out = h @ w2 + b2
    d_out = 2 * (out - Y) / out.size
    with cs.patch(model, {"m/d1": lambda value: value * 2.0}):
        result = cs.intermediate_grads(model, fn, *args, select=["*d1", "*d2"])
        direct = numpy(fn(*args))
    assert float(numpy(result.loss)) == pytest.approx(np.mean((out - Y) ** 2), rel=1e-5)
    assert float(direct) == pytest.approx(float(numpy(result.loss)), rel=1e-6)
    np.testing.assert_allclose(_one(result.outputs, "d1:output"), h, rtol=1e-5)
    np.testing.assert_allclose(_one(result.grads, "d2:grad"), d_out, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_one(result.grads, "d1:grad"), d_out @ w2.T, rtol=1e-5,
                               atol=1e-7)
    # Nothing stays: outside the scope the model is unpatched again.
    again = cs.intermediate_grads(model, fn, *args, select=["*d1", "*d2"])
    ref = _reference(model)
    assert float(numpy(again.loss)) == pytest.approx(ref["loss"], rel=1e-5)
    np.testing.assert_allclose(_one(again.grads, "d1:grad"), ref["d1"], rtol=1e-5, atol=1e-7)


def test_intermediate_grads_refuses_a_glob_of_a_list_that_matched_nothing():
    model = _model()
    fn, args = _mse_fn(model)
    with pytest.raises(ValueError, match=r"cs.intermediate_grads: \['\*d9'\] of the globs in "
                                         r"`select` matched no point that `loss_fn` ran "
                                         r"through. Nearest points: .*the other globs' "
                                         r"gradients were taken.*Received: select="
                                         r"\['\*d1', '\*d9'\]"):
        cs.intermediate_grads(model, fn, *args, select=["*d1", "*d9"])
    result = cs.intermediate_grads(model, fn, *args, select=["*d1", "m/d*"])
    assert sorted(result.grads) == ["m/d1:grad", "m/d2:grad"]
    np.testing.assert_allclose(_one(result.grads, "d1:grad"), _reference(model)["d1"],
                               rtol=1e-5, atol=1e-7)
    # Called inside another model, its points are named from it down, as selected.
    outer = cs.Sequential([keras.Input(X.shape[1:]), model], name="outer")
    outer_fn, outer_args = _mse_fn(outer)
    cs.intermediate_grads(outer, outer_fn, *outer_args, select="*d1")
    result = cs.intermediate_grads(model, outer_fn, *outer_args, select=["m/d1", "m/d2"])
    assert sorted(result.grads) == ["m/d1:grad", "m/d2:grad"]
    np.testing.assert_allclose(_one(result.grads, "d1:grad"), _reference(model)["d1"],
                               rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"\['m/d9'\] of the globs"):
        cs.intermediate_grads(model, outer_fn, *outer_args, select=["m/d1", "m/d9"])


def test_intermediate_grads_refuses_what_it_cannot_apply():
    model = _model()
    fn, args = _mse_fn(model)
    with cs.patch(model, {"m/d9": lambda value: value}):
        with pytest.raises(ValueError, match=r"cs.patch never reached \['m/d9'\] in this "
                                             r"`loss_fn`.*Received: patches=\['m/d9'\]"):
            cs.intermediate_grads(model, fn, *args, select="*d1")
    # Given a plain model around it: the same error, with no points of its own to list.
    plain = keras.Sequential([model])
    plain(X)
    plain_fn, plain_args = _mse_fn(plain)
    with cs.patch(model, {"m/d9": lambda value: value}):
        with pytest.raises(ValueError, match=r"never reached \['m/d9'\] in this `loss_fn`: "
                                             r"no layer or sown value that the call ran has "
                                             r"that point\. Use `cs.points"):
            cs.intermediate_grads(plain, plain_fn, *plain_args, select="*d1")
    # A capture would miss the call: it records calls, and this is not one.
    with cs.capture(model, "*") as captured:
        with pytest.raises(ValueError, match=r"A cs.capture of `m` is open around "
                                             r"cs.intermediate_grads.*Received: an open "
                                             r"cs.capture of `m`"):
            cs.intermediate_grads(model, fn, *args, select="*d1")
    assert dict(captured) == {}
    # A patch on a model outside the one given would be lost.
    other = _model()
    other_fn, other_args = _mse_fn(other)
    with cs.patch(other, {"m/d1": lambda value: value * 0.0}):
        with pytest.raises(ValueError, match=r"patched at \['m/d1'\] by another scope.*"
                                             r"Received: model=`m`"):
            cs.intermediate_grads(model, lambda *a: fn(*args) + other_fn(*other_args),
                                  *args, select="*d1")
    # Inside the user's own compiled function, a cached run would keep the patch.
    if BACKEND == "jax":
        import jax

        compiled = jax.jit(lambda tv, x: cs.intermediate_grads(model, fn, tv, x,
                                                               select="*d1").loss)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(lambda x: cs.intermediate_grads(model, fn, x,
                                                               select="*d1").loss)
    else:
        compiled = None
    if compiled is not None:
        # A `loss_fn` that closes over the traced values: no tracer among the args.
        closed = (jax.jit if BACKEND == "jax" else tf.function)(
            lambda *a: cs.intermediate_grads(model, lambda: fn(*a), select="*d1").loss)
        for traced in (compiled, closed):
            with cs.patch(model, {"m/d1": lambda value: value * 2.0}):
                with pytest.raises(RuntimeError, match=r"cs.patch cannot change a function "
                                                       r"it did not compile.*Received: a "
                                                       r"traced cs.intermediate_grads under "
                                                       r"patches of \['m/d1'\]"):
                    traced(*args)
    # None of it stays behind.
    result = cs.intermediate_grads(model, fn, *args, select="*d1")
    np.testing.assert_allclose(_one(result.grads, "d1:grad"), _reference(model)["d1"],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(BACKEND == "jax", reason="JAX refuses custom train_steps with grads")
def test_a_custom_step_gives_the_gradient_of_what_its_compute_loss_returned():
    """The gradient is of the value `compute_loss` returned, whatever the step does
    with it after (here twice it, plus a term of its own), as the README says: the
    gradient of the step's own loss comes from cs.intermediate_grads in the step."""

    class Doubles(cs.Sequential):
        def train_step(self, *args):
            x, y = args[0][:2] if isinstance(args[0], tuple) else args[:2]
            if BACKEND == "tensorflow":
                import tensorflow as tf

                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = 2.0 * self.compute_loss(x=x, y=y, y_pred=y_pred)
                    loss += keras.ops.mean(y_pred ** 2)
                self.optimizer.apply_gradients(
                    zip(tape.gradient(loss, self.trainable_variables),
                        self.trainable_variables))
            else:
                self.zero_grad()
                y_pred = self(x, training=True)
                loss = 2.0 * self.compute_loss(x=x, y=y, y_pred=y_pred)
                loss += keras.ops.mean(y_pred ** 2)
                loss.backward()
                self.optimizer.apply([v.value.grad for v in self.trainable_variables],
                                     self.trainable_variables)
            return {"loss": loss}

    model = _model(Doubles)
    ref = _reference(model)
    with cs.capture(model, "m/d?", kinds=("grad",)) as cap:
        model.train_on_batch(X, Y)
    for name in ("d1", "d2"):
        np.testing.assert_allclose(cap[f"m/{name}:grad"], ref[name], rtol=1e-5, atol=1e-7)


class _IntermediateGradsStep(cs.Sequential):
    """A train_step that takes its gradients with cs.intermediate_grads (the way
    out of two `compute_loss` calls); the step calls the model only in `loss_fn`."""

    def train_step(self, *step):
        data = step[-1]
        x, y = data[0], data[1]
        if BACKEND == "jax":
            tv, ntv = step[0][0], step[0][1]

            def fn(tv, x):
                y_pred, _ = self.stateless_call(tv, ntv, x, training=True)
                return self.compute_loss(x=x, y=y, y_pred=y_pred)

            result = cs.intermediate_grads(self, fn, tv, x, select="*d1")
        else:
            def fn(x):
                return self.compute_loss(x=x, y=y, y_pred=self(x, training=True))

            result = cs.intermediate_grads(self, fn, x, select="*d1")
        logs = {"loss_seen": result.loss, "d1_grad_sum": keras.ops.sum(result.grads["m/d1:grad"])}
        return (logs, step[0]) if BACKEND == "jax" else logs


def test_a_capture_records_the_points_of_intermediate_grads_inside_a_step():
    """Inside a recording step, `loss_fn`'s points go to the step's capture as well:
    cs.intermediate_grads' own collector once shadowed the step's, and the capture
    missed them (here: selected nothing)."""
    model = _model(_IntermediateGradsStep)
    ref = _reference(model)
    w1, b1 = _weights(model, "d1")
    with cs.capture(model, ["*d1", "*d2"]) as captured:
        history = model.fit(X, Y, batch_size=len(X), epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(numpy(captured["m/d1:output"]), X @ w1 + b1, rtol=1e-5,
                               atol=1e-6)
    assert numpy(captured["m/d2:output"]).shape == (len(X), 1)
    assert history.history["loss_seen"][0] == pytest.approx(ref["loss"], rel=1e-5)
    assert history.history["d1_grad_sum"][0] == pytest.approx(float(ref["d1"].sum()),
                                                              rel=1e-4, abs=1e-6)


def test_a_gradient_capture_of_a_step_whose_loss_intermediate_grads_takes_is_refused():
    """Its `compute_loss` runs inside cs.intermediate_grads: the step's gradient
    capture sees no loss, and says why (it said to call `compute_loss`, which the
    step does). On JAX a custom train_step under a gradient capture is refused
    before it runs."""
    model = _model(_IntermediateGradsStep)
    match = (r"differentiates through callscope's own copy of Keras's train_step"
             if BACKEND == "jax" else
             r"found no loss in this train_step: its `compute_loss` ran inside "
             r"cs.intermediate_grads.*Received: cs.intermediate_grads in a step under a "
             r"gradient capture")
    with pytest.raises(ValueError, match=match):
        with cs.capture(model, "*d2", kinds=("output", "grad")):
            model.fit(X, Y, batch_size=len(X), epochs=1, verbose=0)
    with cs.capture(model, "*d2") as captured:  # nothing stays behind
        model.fit(X, Y, batch_size=len(X), epochs=1, verbose=0)
    assert numpy(captured["m/d2:output"]).shape == (len(X), 1)


def _stateful_model():
    keras.utils.set_random_seed(1)
    inp = keras.Input((5, 3), batch_size=4)
    h = keras.layers.BatchNormalization(name="bn")(inp)
    if BACKEND != "torch":  # (torch's dropout draws from torch's own global generator)
        h = keras.layers.Dropout(0.3, name="drop")(h)
    h = keras.layers.LSTM(6, stateful=True, name="r")(h)
    return cs.Model(inp, keras.layers.Dense(2, name="head")(h), name="m")


def test_intermediate_grads_keeps_the_state_its_call_updates():
    # On JAX the trace wrote tracers into the moving statistics, the RNN's state and
    # the dropout's seed: the model raised UnexpectedTracerError ever after.
    x = np.random.default_rng(2).normal(size=(4, 5, 3)).astype("float32")
    y = np.random.default_rng(3).normal(size=(4, 2)).astype("float32")
    model, reference = _stateful_model(), _stateful_model()
    model(x)
    reference(x)
    target = keras.ops.convert_to_tensor(y)
    result = cs.intermediate_grads(
        model, lambda: keras.ops.mean((model(x, training=True) - target) ** 2), select="m/r")
    want = numpy(reference(x, training=True))  # as a direct call updates it
    loss = numpy(keras.ops.stop_gradient(result.loss))  # (torch: it keeps its graph)
    np.testing.assert_allclose(loss, np.mean((want - y) ** 2), rtol=1e-5)
    for got, expected in zip(model.non_trainable_variables, reference.non_trainable_variables):
        np.testing.assert_allclose(numpy(got), numpy(expected), rtol=1e-5, atol=1e-6,
                                   err_msg=got.path)
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0),
                               reference.predict(x, batch_size=4, verbose=0), rtol=1e-5)


def test_intermediate_grads_keeps_the_losses_layers_add():
    # On JAX, the scope that keeps the state dropped `add_loss`'s losses (the
    # loss read without its activity term), and a weight regularizer read None.
    keras.utils.set_random_seed(4)
    model = cs.Sequential([keras.Input((3,)), keras.layers.Dense(
        4, name="d", activity_regularizer=keras.regularizers.L2(10.0),
        kernel_regularizer=keras.regularizers.L2(0.5))], name="m")
    model(X)
    target = keras.ops.convert_to_tensor(np.ones((5, 4), "float32"))

    def loss_fn():
        out = model(X)
        return keras.ops.mean((out - target) ** 2) + keras.ops.sum(model.losses)

    result = cs.intermediate_grads(model, loss_fn, select="m/d")
    kernel, bias = model.get_weights()
    out = X @ kernel + bias
    want = np.mean((out - 1) ** 2) + 10.0 * np.sum(out**2) / len(X) + 0.5 * np.sum(kernel**2)
    np.testing.assert_allclose(numpy(keras.ops.stop_gradient(result.loss)), want, rtol=1e-5)


@pytest.mark.parametrize("outer", ["none", "collecting", "not collecting"])
def test_intermediate_grads_leaves_the_losses_where_a_direct_call_does(outer):
    # On JAX, inside a scope that collects losses (a stateless step's), the
    # activity loss reached its list as a tracer of intermediate_grads' trace:
    # reading it raised JAX's UnexpectedTracerError. Outside any scope,
    # `model.losses` after the call was empty.
    keras.utils.set_random_seed(4)
    model = cs.Sequential([keras.Input((3,)), keras.layers.Dense(
        4, name="d", activity_regularizer=keras.regularizers.L2(10.0))], name="m")
    model(X)
    kernel, bias = model.get_weights()
    activity = 10.0 * np.sum((X @ kernel + bias) ** 2) / len(X)
    mapping = [(v, v.value) for v in model.weights]

    def opened():
        if outer == "none":
            return contextlib.nullcontext()
        return keras.StatelessScope(state_mapping=mapping,
                                    collect_losses=outer == "collecting")

    def loss_fn():
        return keras.ops.mean(model(X) ** 2)

    for run in (lambda: model(X),
                lambda: cs.intermediate_grads(model, loss_fn, select="m/d")):
        with opened() as scope:
            model(X)  # (an earlier call's loss, which the next call clears)
            run()
            losses = [float(numpy(loss)) for loss in model.losses]
            listed = [float(numpy(loss)) for loss in scope.losses] if scope else None
        want = [] if outer == "not collecting" else [activity]
        np.testing.assert_allclose(losses, want, rtol=1e-5)
        if outer == "collecting":
            np.testing.assert_allclose(listed, [activity], rtol=1e-5)
    if outer != "collecting":
        return
    # A loss the caller adds to the scope itself is no layer's, even where the
    # caller's `self` is the model (it was credited to the model: its losses read
    # [3.0, activity], 9.18 where a direct run reads 6.18).
    for run in (lambda fn: fn(), lambda fn: cs.intermediate_grads(model, fn, select="m/d")):
        with opened() as scope:
            def own_loss(self=model):
                out = self(X)
                scope.add_loss(keras.ops.convert_to_tensor(3.0))
                return keras.ops.mean(out ** 2)

            run(own_loss)
            losses = [float(numpy(loss)) for loss in model.losses]
            listed = [float(numpy(loss)) for loss in scope.losses]
        np.testing.assert_allclose(losses, [activity], rtol=1e-5)
        np.testing.assert_allclose(sorted(listed), sorted([activity, 3.0]), rtol=1e-5)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.vmap")
def test_intermediate_grads_drops_the_losses_of_a_call_under_the_users_vmap():
    # Their tracers cannot leave the vmap: returned out of the trace, they raised
    # JAX's ConcretizationTypeError.
    import jax

    keras.utils.set_random_seed(4)
    model = cs.Sequential([keras.Input((3,)), keras.layers.Dense(
        4, name="d", activity_regularizer=keras.regularizers.L2(10.0))], name="m")
    model(X)

    def loss_fn():
        first = keras.ops.mean(model(X) ** 2)
        out = jax.vmap(lambda row: model(row[None])[0])(X)
        return keras.ops.mean(out ** 2) + first

    result = cs.intermediate_grads(model, loss_fn, select="*")
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(numpy(result.loss), 2 * np.mean((X @ kernel + bias) ** 2),
                               rtol=1e-5)
    assert model.losses == []  # (the vmapped call, the last, cleared the first's)


@pytest.mark.skipif(BACKEND != "torch", reason="Keras assigns a state in place on torch")
def test_a_gradient_that_an_in_place_state_breaks_is_refused_by_name():
    # Stacked stateful RNNs: torch's own error ("modified by an inplace operation
    # ... version 2"), naming no point, from an evaluate that works without it.
    x = np.random.default_rng(0).normal(size=(4, 5, 3)).astype("float32")
    inp = keras.Input((5, 3), batch_size=4)
    h = keras.layers.LSTM(6, stateful=True, return_sequences=True, name="r")(inp)
    h = keras.layers.GRU(6, stateful=True, name="g")(h)
    model = cs.Model(inp, keras.layers.Dense(2, name="head")(h), name="m")
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(RuntimeError, match=r"could not take the gradients of \['m/r'\]: the "
                       r"backward pass needs a value that a layer changed in place"):
        with cs.capture(model, "m/r", kinds=("grad",)):
            model.evaluate(x, np.zeros((4, 2), "float32"), batch_size=4, verbose=0)


@pytest.mark.parametrize("activation, loss, units", [
    ("sigmoid", "binary_crossentropy", 1), ("softmax", "categorical_crossentropy", 2)])
def test_a_gradient_capture_keeps_the_loss_that_keras_computes_from_logits(
        activation, loss, units):
    # On TF, Keras computes a crossentropy from the logits it keeps on a sigmoid's or
    # softmax's output. A gradient capture of that output dropped them: the loss of
    # saturated rows read 16.03 (from clipped probabilities) for 40, and fit trained
    # on it, with no error.
    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((1,))
        hidden = keras.layers.Dense(3, name="hidden")(inputs)
        model = cs.Model(inputs, keras.layers.Dense(units, activation=activation,
                                                    name="head")(hidden), name="m")
        model.set_weights([np.ones((1, 3), "float32"), np.zeros(3, "float32"),
                           np.array([[13.0, -13.0][:units]] * 3, "float32"),
                           np.zeros(units, "float32")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        return model

    x = np.array([[1.0], [-1.0], [0.05]], "float32")
    y = np.array([[0.0], [1.0], [1.0]] if units == 1 else [[0, 1], [1, 0], [0, 1]], "float32")
    plain, captured = build(), build()
    expected = plain.evaluate(x, y, verbose=0)
    with cs.capture(captured, "*", kinds=("output", "grad")) as cap:
        got = captured.evaluate(x, y, verbose=0)
    assert got == pytest.approx(expected, rel=1e-6)
    # So did a patch that returns the output as it is (TF's shape check in the
    # graph made a new tensor of it).
    with cs.patch(captured, {"m/head": lambda h: h}):
        assert captured.evaluate(x, y, verbose=0) == pytest.approx(expected, rel=1e-6)
    # The hidden layer's gradient is the backend's own, through the logits on TF.
    w = numpy(captured.get_layer("head").kernel)
    hidden = x @ np.ones((1, 3))
    logits = hidden @ w
    if units == 1:
        dlogits = (1 / (1 + np.exp(-logits)) - y) / len(x)
    else:
        e = np.exp(logits - logits.max(-1, keepdims=True))
        dlogits = (e / e.sum(-1, keepdims=True) - y) / len(x)
    if BACKEND == "tensorflow":
        np.testing.assert_allclose(cap["m/hidden:grad"], dlogits @ w.T, rtol=1e-4, atol=1e-6)
        assert "m/head:grad" not in cap.keys()  # the loss does not pass through it
        with pytest.raises(ValueError, match=r"d loss / d `m/head` is not taken on "
                                             r"TensorFlow: .*crossentropy from the logits"):
            with cs.capture(captured, "m/head", kinds=("grad",)):
                captured.evaluate(x, y, verbose=0)
    else:  # from clipped probabilities, through the output, as the loss is computed
        assert cap["m/head:grad"].shape == (3, units)
    plain.fit(x, y, batch_size=3, epochs=2, verbose=0, shuffle=False)
    with cs.capture(captured, "*", kinds=("grad",)):
        captured.fit(x, y, batch_size=3, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(plain.get_weights(), captured.get_weights()):
        np.testing.assert_array_equal(a, b)
