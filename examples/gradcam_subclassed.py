"""Grad-CAM on a small subclassed CNN: no functional model needed.

Grad-CAM weighs the last convolution's feature maps by the gradient of the class
score with respect to them. With a subclassed model there is no `layer.output`
graph to build a functional "grad model" from; `cs.intermediate_grads` gets both
the feature maps and their gradient in one forward pass, on any backend.

Run: python examples/gradcam_subclassed.py [--out gradcam.png]
"""

import argparse

import keras
import numpy as np

import callscope as cs


class ConvBlock(keras.layers.Layer):
    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")

    def call(self, x):
        return self.conv(x)


class SmallCNN(cs.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block_0 = ConvBlock(8, name="block_0")
        self.block_1 = ConvBlock(16, name="block_1")
        self.pool = keras.layers.MaxPooling2D(2)
        self.flatten = keras.layers.Flatten()
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        # Flatten keeps where things are: the class depends on the square's side.
        return self.head(self.flatten(self.pool(self.block_1(self.block_0(x)))))


def make_images(n, rng):
    """A bright 4x4 square on the left (class 0) or the right (class 1) of a 16x16 image."""
    images = rng.normal(0.0, 0.1, size=(n, 16, 16, 1)).astype("float32")
    labels = rng.integers(0, 2, size=n)
    for image, label in zip(images, labels):
        row = rng.integers(2, 10)
        col = rng.integers(1, 4) if label == 0 else rng.integers(9, 12)
        image[row:row + 4, col:col + 4, 0] += 1.0
    return images, labels


def grad_cam(model, images, class_index):
    """Heatmaps (N, H, W) in [0, 1] for `class_index`."""
    x = keras.ops.convert_to_tensor(images)
    if keras.backend.backend() == "jax":  # stateless: a pure function of its inputs
        tv = [v.value for v in model.trainable_variables]
        ntv = [v.value for v in model.non_trainable_variables]

        def score(x):
            logits, _ = model.stateless_call(tv, ntv, x)
            return keras.ops.sum(logits[:, class_index])
    else:
        def score(x):
            return keras.ops.sum(model(x)[:, class_index])

    point = "small_cnn/block_1"
    result = cs.intermediate_grads(model, score, x, select=point)
    maps = keras.ops.convert_to_numpy(result.outputs[f"{point}:output"])
    grads = keras.ops.convert_to_numpy(result.grads[f"{point}:grad"])
    weights = grads.mean(axis=(1, 2), keepdims=True)  # one weight per channel
    cam = np.maximum((weights * maps).sum(axis=-1), 0)
    return cam / (cam.max(axis=(1, 2), keepdims=True) + 1e-8)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gradcam.png")
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = make_images(512, rng)
    model = SmallCNN(name="small_cnn")
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=6, batch_size=32, verbose=0)
    _, accuracy = model.evaluate(x, y, verbose=0)
    print(f"accuracy {accuracy:.3f}")

    test_x, test_y = make_images(4, np.random.default_rng(1))
    cams = np.stack([grad_cam(model, test_x[i:i + 1], int(test_y[i]))[0] for i in range(4)])
    for cam, label in zip(cams, test_y):
        left, right = cam[:, :8].sum(), cam[:, 8:].sum()
        side = "left" if left > right else "right"
        print(f"class {label}: heat on the {side} ({left:.1f} vs {right:.1f})")
        assert side == ("left" if label == 0 else "right"), "Grad-CAM points at the square"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(10, 5))
    for i in range(4):
        axes[0, i].imshow(test_x[i, :, :, 0], cmap="gray")
        axes[0, i].set_title(f"input, class {test_y[i]}")
        axes[1, i].imshow(test_x[i, :, :, 0], cmap="gray")
        axes[1, i].imshow(cams[i], cmap="jet", alpha=0.5, vmin=0, vmax=1)
        axes[1, i].set_title("Grad-CAM (block_1)")
        for ax in axes[:, i]:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
