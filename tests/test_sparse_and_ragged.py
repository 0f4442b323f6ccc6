"""Sparse and ragged values at points: captured as the dense values they stand for
(sparse), or refused where a full capture would pad them (ragged)."""

import keras
import numpy as np
import pytest
from conftest import BACKEND

import callscope as cs

pytestmark = pytest.mark.skipif(
    BACKEND == "torch", reason="Keras has no sparse or ragged tensors on torch")

X = np.array([[1.0, -1, 2], [0, 3, -4], [-1, -1, 5], [2, 0, 0]], "float32")


def _sparse(x):
    if BACKEND == "jax":
        from jax.experimental import sparse

        return sparse.BCOO.fromdense(x, nse=int(np.prod(x.shape)))  # (static in a jit)
    import tensorflow as tf

    return tf.sparse.from_dense(x)


class ToSparse(keras.layers.Layer):
    def call(self, x):
        return _sparse(keras.ops.relu(x))

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, x.dtype, sparse=True)


class Net(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sp = ToSparse(name="sp")
        self.d = keras.layers.Dense(2, name="d", kernel_initializer="ones")

    def call(self, x):
        s = self.sp(x)
        cs.sow(self, "sown", s)
        return self.d(s)


def test_a_sparse_point_is_captured_as_its_dense_values():
    # JAX stacked the BCOO arrays into a numpy array of Python objects (an error
    # only when read as numbers); TF's statistics of a sparse point raised TF's
    # own conversion error.
    model = Net(name="net")
    model.compile(loss="mse")
    dense = np.maximum(X, 0)
    with cs.capture(model, ["net/sown", "net/sp", "net/d"], kinds=("output", "input")) as full:
        out = model.predict(X, batch_size=2, verbose=0)
    np.testing.assert_allclose(out, dense @ np.ones((3, 2)), rtol=1e-6)
    for key in ("net/sown:output", "net/sp:output", "net/d:input"):
        assert full[key].dtype == np.float32
        np.testing.assert_array_equal(full[key], dense)
    with cs.capture(model, "net/sp", reduce=("mean", "std", "frac_zero")) as stats:
        model.predict(X, batch_size=2, verbose=0)
    np.testing.assert_allclose(stats["net/sp:output/mean"], dense.mean(), rtol=1e-6)
    np.testing.assert_allclose(stats["net/sp:output/std"], dense.std(), rtol=1e-5)
    np.testing.assert_allclose(stats["net/sp:output/frac_zero"], np.mean(dense == 0))
    # No backend takes a gradient at a sparse value: named, it raises; a glob
    # leaves it out.
    with pytest.raises(ValueError, match=r"d loss / d `net/sp` is not taken: the value of "
                                         r"`net/sp` is a sparse tensor"):
        with cs.capture(model, "net/sp", kinds=("grad",)):
            model.evaluate(X, np.zeros((4, 2)), verbose=0)
    with cs.capture(model, "*", kinds=("grad",)) as grads:
        model.evaluate(X, np.zeros((4, 2)), batch_size=4, verbose=0)
    assert "net/sp:grad" not in grads.keys() and "net/d:grad" in grads.keys()


def test_a_sparse_input_is_captured_and_patched():
    # TF: a `tf.SparseTensor` input broke every capture and patch ("'SparseTensor'
    # object is not subscriptable").
    inputs = keras.Input((3,), sparse=True)
    model = cs.Model(inputs, keras.layers.Dense(2, name="d")(inputs), name="m")
    w, b = (keras.ops.convert_to_numpy(v) for v in model.get_layer("d").weights)
    with cs.capture(model, "m/d", kinds=("input", "output")) as cap:
        out = model.predict(_sparse(X), batch_size=4, verbose=0)
    np.testing.assert_array_equal(cap["m/d:input"], X)
    np.testing.assert_allclose(cap["m/d:output"], X @ w + b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, X @ w + b, rtol=1e-5, atol=1e-6)
    with cs.patch(model, {"m/d": keras.ops.zeros_like}):
        np.testing.assert_array_equal(model.predict(_sparse(X), batch_size=4, verbose=0), 0)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="ragged tensors are TensorFlow's")
def test_a_ragged_point_has_statistics_and_refuses_a_full_capture():
    # A full capture padded the rows of each batch with zeros, which read as
    # values ([[2, 4, 0], [6, 0, 0], ...] for [[2, 4], [6], ...]).
    import tensorflow as tf

    class Double(keras.layers.Layer):
        def call(self, x):
            return x * 2.0

        def compute_output_spec(self, x):
            return keras.KerasTensor(x.shape, x.dtype, ragged=True)

    class RowSum(keras.layers.Layer):
        def call(self, x):
            return tf.reduce_sum(x, axis=1, keepdims=True)

    inputs = keras.Input((None,), ragged=True)
    model = cs.Model(inputs, RowSum(name="sum")(Double(name="dbl")(inputs)), name="m")
    data = tf.ragged.constant([[1.0, 2.0], [3.0], [-4.0, 5.0, 6.0], [7.0]])
    values = 2 * np.array([1.0, 2, 3, -4, 5, 6, 7])
    for point in ("m/dbl", ("m/sum", "input")):
        select, kind = (point, "output") if isinstance(point, str) else point
        with pytest.raises(ValueError, match=rf"`{select}:{kind}` is a ragged tensor, whose "
                                             r"rows differ in length.*reduce="):
            with cs.capture(model, select, kinds=(kind,)):
                model.predict(data, batch_size=4, verbose=0)
    with cs.capture(model, "m/dbl", reduce=("mean", "min", "frac_zero")) as stats:
        model.predict(data, batch_size=2, verbose=0)
    np.testing.assert_allclose(stats["m/dbl:output/mean"], values.mean(), rtol=1e-6)
    assert stats["m/dbl:output/min"] == -8 and stats["m/dbl:output/frac_zero"] == 0
    with cs.capture(model, "m/sum") as rows:
        model.predict(data, batch_size=4, verbose=0)
    np.testing.assert_allclose(rows["m/sum:output"], [[6.0], [6.0], [14.0], [14.0]])
    with pytest.raises(ValueError, match=r"The patch of `m/dbl` would replace a ragged "):
        with cs.patch(model, {"m/dbl": lambda v: v * 0.5}):
            model.predict(data, batch_size=4, verbose=0)
    with cs.patch(model, {"m/sum": lambda v: v + 1.0}):
        np.testing.assert_allclose(model.predict(data, batch_size=4, verbose=0),
                                   [[7.0], [7.0], [15.0], [15.0]])
