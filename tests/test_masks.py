"""Keras masks survive what callscope puts in the model's place: a gradient
capture's source tensor and a patch's value keep the mask of the value they
replace, so a model that masks its padding goes on masking it."""

import keras
import numpy as np
import pytest
from conftest import numpy

import callscope as cs
from callscope import _keras_compat

TOKENS = np.array([[3, 4, 5, 6], [7, 8, 0, 0], [9, 0, 0, 0], [1, 2, 3, 0]], "int32")
Y = np.random.default_rng(0).normal(size=(4, 2)).astype("float32")
PADDED = TOKENS == 0


class MaskedBlock(keras.layers.Layer):
    """Returns its LSTM's output, which carries the embedding's mask (this layer
    does not support masking, so Keras sets no mask on its output: the one it
    has is the LSTM's), and a second element."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = keras.layers.Embedding(20, 4, mask_zero=True, name="emb")
        self.lstm = keras.layers.LSTM(3, return_sequences=True, name="lstm")

    def call(self, tokens):
        e = cs.sow(self, "e", self.emb(tokens))  # a sown value carrying a mask
        return self.lstm(e), keras.ops.sum(e, axis=-1)


class Net(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = MaskedBlock(name="blk")
        self.lstm2 = keras.layers.LSTM(3, name="lstm2")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, tokens):
        h, _ = self.block(tokens)
        return self.head(self.lstm2(h))


def _net():
    keras.utils.set_random_seed(0)
    net = Net(name="net")
    net.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    net(TOKENS[:1])
    return net


def _weights(net):
    return [numpy(w) for w in net.weights]


@pytest.mark.parametrize("point, key", [("net/blk/e", "net/blk/e"), ("net/blk/0", "net/blk/0"),
                                        ("net/blk", "net/blk/0")])
def test_a_gradient_capture_keeps_the_mask(point, key):
    net = _net()
    stock = net.evaluate(TOKENS, Y, verbose=0)
    start = [w.copy() for w in _weights(net)]
    net.fit(TOKENS, Y, epochs=1, verbose=0, shuffle=False)
    trained = _weights(net)
    net.set_weights(start)
    with cs.capture(net, point, kinds=("grad",)) as grads:
        loss = net.evaluate(TOKENS, Y, verbose=0)
    # Without the mask the loss moves by ~3e-4 of itself (the padding is read).
    np.testing.assert_allclose(loss, stock, rtol=1e-6)
    grad = grads[f"{key}:grad"]
    assert np.all(grad[PADDED] == 0), np.abs(grad[PADDED]).max()  # masked steps: no say
    assert np.all(np.abs(grad[~PADDED]).max(axis=-1) > 0)
    with cs.capture(net, point, kinds=("grad",)):
        net.fit(TOKENS, Y, epochs=1, verbose=0, shuffle=False)
    for got, want in zip(_weights(net), trained):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def _plus_zero(value):
    if isinstance(value, tuple):
        return value[0] + 0.0, value[1] + 0.0
    return value + 0.0


@pytest.mark.parametrize("point", ["net/blk/e", "net/blk/0", "net/blk"])
def test_a_patch_keeps_the_mask_of_the_value_it_replaces(point):
    net = _net()
    stock = numpy(net.predict(TOKENS, verbose=0))
    with cs.patch(net, {point: _plus_zero}):
        patched = numpy(net.predict(TOKENS, verbose=0))
        direct = numpy(net(TOKENS))
    np.testing.assert_allclose(patched, stock, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(direct, stock, rtol=1e-6, atol=1e-7)


def test_a_tensor_the_patch_keeps_is_not_marked():
    # A patch that returns its own constant gets the mask on a copy: the constant
    # carries no mask afterwards (in a later call, or anywhere else it is used).
    net = _net()
    kept = keras.ops.convert_to_tensor(np.ones((4, 4, 4), "float32"))
    with cs.patch(net, {"net/blk/e": lambda value: kept}):
        net.predict(TOKENS, batch_size=4, verbose=0)
        net(TOKENS)
    assert _keras_compat.keras_mask(kept) is None
