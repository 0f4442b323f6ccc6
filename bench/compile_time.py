"""What a statistics capture costs to compile: its first predict ÷ a plain first predict.

One process per backend (the backend is fixed when keras is imported). A model's
first `predict` compiles its step (two steps where the last batch is shorter); the
first `predict` under `cs.capture(model, "*", reduce=...)` compiles another, with
each point's statistics and the levels they fall back to where the data needs
them (`_reduce.partials`). Prints each first predict, the one after it (compiled
already), and their ratios. On torch nothing compiles: the figures are its eager
first steps.

Usage:
    KERAS_BACKEND=jax python bench/compile_time.py
    KERAS_BACKEND=jax python bench/compile_time.py --reduce mean,std --rows 32
"""

import argparse
import os

import keras
import numpy as np

import callscope as cs
from _paired import seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reduce", default="mean,std,min,max,frac_zero")
    parser.add_argument("--rows", type=int, default=37, help="37 at batch 16: two steps")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    reduce = tuple(args.reduce.split(","))
    model = cs.enable(keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, include_preprocessing=False))
    x = np.random.default_rng(0).normal(size=(args.rows, 32, 32, 3)).astype("float32")
    model(x[:2])  # built, and the backend started, before anything is timed

    def predict():
        model.predict(x, batch_size=args.batch, verbose=0)

    def captured():
        with cs.capture(model, "*", reduce=reduce) as stats:
            predict()
        return stats

    plain_first, plain_again = seconds(predict), seconds(predict)
    captured_first, captured_again = seconds(captured), seconds(captured)
    points = len(captured()) // len(reduce)
    print(f"backend={keras.backend.backend()} MobileNetV3Small(32x32) rows={args.rows} "
          f"batch={args.batch} reduce={','.join(reduce)} keys={points}x{len(reduce)} "
          f"cpus={os.cpu_count()}")
    print(f"plain predict: first {plain_first:.2f} s, again {plain_again:.3f} s")
    print(f"captured predict: first {captured_first:.2f} s, again {captured_again:.3f} s")
    print(f"first captured ÷ first plain: {captured_first / plain_first:.1f}x; "
          f"again: {captured_again / plain_again:.2f}x")


if __name__ == "__main__":
    main()
