"""The second seed: the SimpleMLP subclassing example, as a `cs.Model`.

Build, summary, fit, save and load work exactly as with `keras.Model`. The one
addition: a `debugging` context argument, reaching a nested layer from `predict`.

Run: python examples/seed_001_subclassing.py
"""

import os
import tempfile

import keras
import numpy as np

import callscope as cs


@cs.context_args("debugging")
class Inspect(keras.layers.Layer):
    """Passes its input through; in debugging mode, zeroes it to show it ran."""

    def call(self, x, debugging=None):
        return x * 0.0 if debugging else x


@keras.saving.register_keras_serializable(package="examples")
class SimpleMLP(cs.Model):
    def __init__(self, num_units_l1, num_units_l2, num_classes, name="simple_mlp", **kwargs):
        super().__init__(name=name, **kwargs)
        self.num_units_l1, self.num_units_l2 = num_units_l1, num_units_l2
        self.num_classes = num_classes
        # Define layers in the constructor
        self.dense_layer_1 = keras.layers.Dense(num_units_l1, activation="relu")
        self.dropout_layer = keras.layers.Dropout(0.5)  # needs the `training` flag
        self.dense_layer_2 = keras.layers.Dense(num_units_l2, activation="relu")
        self.inspect = Inspect()
        self.output_layer = keras.layers.Dense(num_classes, activation="softmax")
        self.register_context_args("debugging")

    def call(self, inputs, training=None):
        x = self.dense_layer_1(inputs)
        x = self.dropout_layer(x, training=training)
        x = self.inspect(self.dense_layer_2(x))
        return self.output_layer(x)

    def get_config(self):
        return {**super().get_config(), "num_units_l1": self.num_units_l1,
                "num_units_l2": self.num_units_l2, "num_classes": self.num_classes}


def main():
    mlp_model = SimpleMLP(num_units_l1=128, num_units_l2=64, num_classes=10)
    mlp_model.build(input_shape=(None, 784))
    mlp_model.summary()

    dummy_input = keras.random.normal([4, 784])
    output_tensor = mlp_model(dummy_input, training=False)
    print("Output shape:", output_tensor.shape)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 784)).astype("float32")
    y = rng.integers(0, 10, size=(256,))
    mlp_model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    history = mlp_model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    print("loss per epoch:", [round(v, 4) for v in history.history["loss"]])

    # debugging=True zeroes the last hidden layer: every row becomes softmax(bias).
    debug_out = mlp_model.predict(x[:4], debugging=True, verbose=0)
    np.testing.assert_allclose(debug_out, np.repeat(debug_out[:1], 4, axis=0), rtol=1e-5)
    plain = mlp_model.predict(x[:4], verbose=0)
    assert not np.allclose(plain, debug_out)

    path = os.path.join(tempfile.mkdtemp(), "simple_mlp.keras")
    mlp_model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(x[:4], verbose=0), plain, rtol=1e-5)
    print(f"saved and loaded back as {type(loaded).__name__}: predictions match")


if __name__ == "__main__":
    main()
