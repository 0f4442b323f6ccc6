"""A 64-position activation-patching sweep: compiles, and time per position.

One process per backend (the backend is fixed when keras is imported). For each
of 64 positions of a (rows, 64, 64) sequence model, one `predict` under a patch
that zeroes that position of a block's output (`cs.patch(..., values=)`), and one
under a patch array that splices a clean run's activations in at that position.
Prints how many compiled functions each sweep made (`make_predict_function`
builds and Python traces of the block: 1 each is the target; torch runs eagerly,
so its traces count steps) and the median time per position ÷ a plain predict.

Usage:
    KERAS_BACKEND=jax python bench/sweep.py
    KERAS_BACKEND=tensorflow python bench/sweep.py --rows 512
"""

import argparse
import statistics
import warnings

import keras
import numpy as np

import callscope as cs
from _paired import seconds

POSITIONS, UNITS = 64, 64
TRACES = []


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(UNITS, activation="relu")

    def call(self, x):
        TRACES.append(1)  # once per trace (JAX, TensorFlow); once per step on torch
        return self.dense(x)


def _model():
    layers = [keras.Input((POSITIONS, UNITS))]
    layers += [Block(name=f"block_{i}") for i in range(4)]
    layers += [keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10, name="head")]
    model = cs.Sequential(layers, name="net")
    model.compile(loss="mse")
    return model


def _zero_position(h, values):
    keep = keras.ops.arange(POSITIONS) != values["position"]
    return h * keras.ops.cast(keep, h.dtype)[None, :, None]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, POSITIONS, UNITS)).astype("float32")
    model = _model()

    def predict():
        return model.predict(x, batch_size=args.batch, verbose=0)

    predict()
    with cs.capture(model, "net/block_1") as clean:
        predict()
    clean_acts = clean["net/block_1:output"]
    plain = [seconds(predict) for _ in range(9)]
    corrupt = model.get_layer("block_1").dense(model.layers[0](x))  # any other values
    corrupt = keras.ops.convert_to_numpy(corrupt)

    sweeps = {
        "values= (zero a position)": lambda p: ({"net/block_1": _zero_position},
                                                {"position": p}),
        "patch array (splice clean)": lambda p: (
            {"net/block_1": np.concatenate([corrupt[:, :p], clean_acts[:, p:p + 1],
                                            corrupt[:, p + 1:]], axis=1)}, None),
    }
    print(f"backend={keras.backend.backend()} rows={args.rows} batch={args.batch} "
          f"positions={POSITIONS}")
    print(f"plain predict: {statistics.median(plain) * 1e3:.1f} ms")
    for name, patch_of in sweeps.items():
        builds_before = len(model._cs_table())
        TRACES.clear()
        times = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for position in range(POSITIONS):
                patches, values = patch_of(position)
                with cs.patch(model, patches, values=values):
                    times.append(seconds(predict))
        keys = len(model._cs_table()) - builds_before
        evicted = sum("evicted" in str(w.message) for w in caught)
        first, rest = times[0], statistics.median(times[1:])
        print(f"{name}: new compiled keys={keys}, traces per block={len(TRACES) // 4}, "
              f"evictions={evicted}, first position {first * 1e3:.1f} ms, "
              f"then median {rest * 1e3:.1f} ms = {rest / statistics.median(plain):.2f}x "
              "plain predict")


if __name__ == "__main__":
    main()
