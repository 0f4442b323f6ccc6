"""The first seed's use case: a `debugging` flag that makes layers show their insides.

RyanSaxe (keras-team/keras#21530) wanted a `debugging` call argument that makes the
layers of a subclassed model expose intermediates, during compiled `fit`, `evaluate`
and `predict`, without changing what the model returns. Here `debugging=True` makes
each block `cs.sow` its pre-activation and gate; `cs.capture` collects them inside
the compiled steps. With `debugging` off, nothing is sown and the compiled graph is
the plain one.

Run: python examples/debugging_flag.py   (any KERAS_BACKEND)
"""

import keras
import numpy as np

import callscope as cs


@cs.context_args("debugging")
class GatedBlock(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)
        self.gate = keras.layers.Dense(units, activation="sigmoid")

    def call(self, x, debugging=None):
        h = self.dense(x)
        g = self.gate(x)
        if debugging:  # a Python bool at trace time: one compiled function per value
            cs.sow(self, "pre_act", h)
            cs.sow(self, "gate", g)
        return keras.ops.relu(h) * g


class Classifier(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [GatedBlock(16, name=f"block_{i}") for i in range(3)]
        self.head = keras.layers.Dense(2, name="head")
        self.register_context_args("debugging")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x[:, 0] * x[:, 1] > 0).astype("int32")
    model = Classifier(name="classifier")
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    # Training, with the debugging flag: statistics of what each block sows, per step.
    with cs.capture(model, reduce=("mean", "std", "frac_zero")) as stats:
        history = model.fit(x, y, batch_size=64, epochs=3, debugging=True, verbose=0)
    print("fit logs are unchanged:", sorted(history.history))
    for key in sorted(stats):
        if key.endswith("pre_act:output/std"):
            print(f"  {key:<40} per step: {np.round(stats[key], 3)}")

    # Evaluation and prediction, compiled, with full tensors.
    with cs.capture(model) as cap:
        loss, acc = model.evaluate(x, y, batch_size=64, debugging=True, verbose=0)
        logits = model.predict(x[:32], debugging=True, verbose=0)
    print(f"evaluate: loss={loss:.3f} accuracy={acc:.3f}; predict returned {logits.shape}")
    # Each call records apart: `cap.calls` holds the evaluate and the predict.
    evaluated, predicted = cap.calls
    print("captured:", {k: v.shape for k, v in predicted.items()})

    # Check against an eager numpy forward pass of the same weights.
    h = x[:32]
    expected = {}
    for block in model.blocks:
        w, b = (np.asarray(keras.ops.convert_to_numpy(v)) for v in block.dense.weights)
        wg, bg = (np.asarray(keras.ops.convert_to_numpy(v)) for v in block.gate.weights)
        pre, gate = h @ w + b, 1 / (1 + np.exp(-(h @ wg + bg)))
        expected[f"classifier/{block.name}/pre_act:output"] = pre
        h = np.maximum(pre, 0) * gate
    for key, value in expected.items():
        # evaluate saw 256 rows, predict 32: the first 32 of each are these rows
        np.testing.assert_allclose(predicted[key], value, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(evaluated[key][:32], value, rtol=1e-4, atol=1e-5)
        assert evaluated[key].shape[0] == 256

    # Without the flag nothing is sown: the capture stays empty and says so.
    try:
        with cs.capture(model):
            model.predict(x[:32], verbose=0)
    except ValueError as error:
        print("without debugging:", str(error).split(":")[0])
    print("the debugging flag exposed every block's intermediates, compiled")


if __name__ == "__main__":
    main()
