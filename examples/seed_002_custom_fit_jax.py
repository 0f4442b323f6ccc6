"""The third seed: a fully stateless JAX `train_step`/`test_step`, as a `cs.Model`.

The context argument `noise` reaches a nested layer through `stateless_call`
(Keras 3.15.1 drops it there; callscope enters it), and `cs.current` reads it
inside the user's own steps. JAX only, as the guide it comes from.

Run: KERAS_BACKEND=jax python examples/seed_002_custom_fit_jax.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import callscope as cs  # noqa: E402


@cs.context_args("noise")
class AddNoise(keras.layers.Layer):
    """Adds a constant offset when the `noise` context argument is set."""

    def call(self, x, noise=None):
        return x + noise if noise is not None else x


class CustomModel(cs.Model):
    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y,
                                 training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training
        )
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, training=True
        )
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        new_metrics_vars, logs = self._update_metrics(metrics_variables, loss, y, y_pred)
        logs["noise"] = float(cs.current("noise", default=0.0))  # static at trace time
        state = (trainable_variables, non_trainable_variables, optimizer_variables,
                 new_metrics_vars)
        return logs, state

    def test_step(self, state, data):
        x, y = data
        trainable_variables, non_trainable_variables, metrics_variables = state
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=False
        )
        loss = self.compute_loss(x, y, y_pred)
        new_metrics_vars, logs = self._update_metrics(metrics_variables, loss, y, y_pred)
        return logs, (trainable_variables, non_trainable_variables, new_metrics_vars)

    def _update_metrics(self, metrics_variables, loss, y, y_pred):
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[
                len(new_metrics_vars) : len(new_metrics_vars) + len(metric.variables)
            ]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        return new_metrics_vars, logs


def main():
    inputs = keras.Input(shape=(32,))
    outputs = AddNoise()(keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
    model = CustomModel(inputs, outputs)
    model.register_context_args("noise")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=["mae"])

    x = np.random.random((64, 32)).astype("float32")
    y = np.zeros((64, 1), "float32")
    history = model.fit(x, y, epochs=1, noise=3.0, verbose=0)
    print("fit(noise=3.0):", {k: round(v[0], 4) for k, v in history.history.items()})
    assert history.history["loss"][0] == 9.0 and history.history["noise"][0] == 3.0
    loss, mae = model.evaluate(x, y, noise=2.0, verbose=0)
    print("evaluate(noise=2.0): loss", loss, "mae", mae)
    assert (loss, mae) == (4.0, 2.0)
    loss, mae = model.evaluate(x, y, verbose=0)
    print("evaluate():          loss", loss, "mae", mae)
    assert (loss, mae) == (0.0, 0.0)
    print("the context reached the layer through stateless_call in the user's own steps")


if __name__ == "__main__":
    main()
