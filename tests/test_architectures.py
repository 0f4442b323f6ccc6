"""Real architectures: MobileNetV2, ResNet50, a keras_hub BERT backbone and an LSTM
text model (tiny configs, no downloads).

For each one: every point is unique and survives `save`/`load_model`; a capture of
every point in `predict` (uneven last batch) matches stock Keras sub-models; and a
patch of one block changes only what follows it.
"""

import re
import warnings
from dataclasses import dataclass, field

import keras
import numpy as np
import pytest
from keras import layers

import callscope as cs

ROWS, BATCH = 5, 2  # predict runs batches of 2, 2, 1
RNG = np.random.default_rng(0)


# --------------------------------------------------------------------------
# The architectures
# --------------------------------------------------------------------------
def _images():
    return RNG.normal(size=(ROWS, 32, 32, 3)).astype("float32")


def _mobilenet_v2():
    with warnings.catch_warnings():  # Keras warns that 32x32 has no pretrained weights
        warnings.simplefilter("ignore", UserWarning)
        # Logits: with random weights its activations shrink block by block, and the
        # softmax would be 0.1 everywhere whatever the blocks did.
        model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3),
                                               alpha=0.35, classes=10,
                                               classifier_activation=None)
    return model, _images()


def _resnet50():
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    return model, _images()


def _tokens(vocabulary, length, pad=True):
    tokens = RNG.integers(1, vocabulary, size=(ROWS, length)).astype("int32")
    mask = np.ones((ROWS, length), "int32")
    if pad:  # rows of different lengths
        for row, n in enumerate(RNG.integers(length // 2, length + 1, size=ROWS)):
            tokens[row, n:], mask[row, n:] = 0, 0
    return tokens, mask


def _bert():
    # A test dependency, never skipped. Imported here, so that a keras_hub that
    # cannot import (against keras-nightly) fails these tests, not the collection.
    import keras_hub

    model = keras_hub.models.BertBackbone(vocabulary_size=50, num_layers=2, num_heads=2,
                                          hidden_dim=8, intermediate_dim=16,
                                          max_sequence_length=12)
    tokens, mask = _tokens(50, 12)
    segments = RNG.integers(0, 2, size=(ROWS, 12)).astype("int32")
    return model, {"token_ids": tokens, "segment_ids": segments, "padding_mask": mask}


def _lstm_text():
    tokens = keras.Input((7,), dtype="int32", name="tokens")
    h = layers.Embedding(30, 6, mask_zero=True, name="emb")(tokens)
    h = layers.LSTM(5, return_sequences=True, name="lstm")(h)
    last, state_h, state_c = layers.LSTM(4, return_state=True, name="lstm_state")(h)
    pooled = layers.GlobalAveragePooling1D(name="pool")(h)
    merged = layers.Concatenate(name="concat")([pooled, last, state_c])
    logits = layers.Dense(3, name="head")(merged)
    model = keras.Model(tokens, logits, name="text")
    return model, _tokens(30, 7)[0]


@dataclass
class Arch:
    build: object
    patch: str  # a mid-model top-level layer whose output the patch test zeroes
    # (add, shortcut): with the residual branch zeroed, `add` is exactly `shortcut`
    residual: tuple | None = None
    cache: dict = field(default_factory=dict)


ARCHS = {
    "mobilenet_v2": Arch(_mobilenet_v2, "block_5_project_BN", ("block_5_add", "block_4_add")),
    "resnet50": Arch(_resnet50, "conv3_block2_3_bn", ("conv3_block2_add", "conv3_block1_out")),
    "bert": Arch(_bert, "transformer_layer_0"),
    "lstm_text": Arch(_lstm_text, "lstm"),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request):
    """Each model is built once (building ResNet50 takes seconds) and shared by the
    tests of its architecture; the unpatched capture is shared too."""
    spec = ARCHS[request.param]
    keras.utils.clear_session()
    keras.utils.set_random_seed(0)
    model, x = spec.build()
    assert cs.enable(model) is model
    spec.cache.update(model=model, x=x)
    yield spec
    spec.cache.clear()


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------
def _is_shape(shape):
    return isinstance(shape, tuple) and all(isinstance(d, int) for d in shape)


def _top_level(model):
    return [layer for layer in model.layers if not isinstance(layer, layers.InputLayer)]


def _keys(point, structure):
    """(key, path) of each tensor of an output (symbolic or computed): `point:output`
    for one tensor, `point/<index or key>:output` for each element of a structure."""
    if not isinstance(structure, (list, tuple, dict)):
        return [(f"{point}:output", ())]
    return [("/".join([point, *map(str, path)]) + ":output", path)
            for path, _ in keras.tree.flatten_with_path(structure)]


def _assert_close(actual, expected, key):
    """rtol 1e-5, and atol 1e-5 of the value's own scale: with random weights the
    deep activations of MobileNetV2 shrink to ~1e-11, where a fixed atol compares
    nothing."""
    expected = np.asarray(expected)
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale, err_msg=key)


def _differs(a, b):
    """`a` and `b` differ by more than 0.1% of `a`'s scale."""
    return np.abs(a - b).max() > 1e-3 * np.abs(a).max()


def _at(structure, path):
    for step in path:
        structure = structure[step]
    return structure


def _layers_of_points(model, x):
    """{point: {id(layer)}} of every recorded value, and {id(layer): (layer, points)},
    from a capture whose `select` callable sees each point with its layer."""
    seen = []

    def select(point, layer):
        seen.append((point, layer))
        return True

    with cs.capture(model, select):
        model(x, training=False)
    by_point, by_layer = {}, {}
    for point, layer in seen:
        by_point.setdefault(point, set()).add(id(layer))
        by_layer.setdefault(id(layer), (layer, set()))[1].add(point)
    return by_point, by_layer


def _baseline(arch):
    """The unpatched capture of every point and the model's output (computed once)."""
    if "baseline" not in arch.cache:
        model, x = arch.cache["model"], arch.cache["x"]
        with cs.capture(model, "*") as cap:
            out = model.predict(x, batch_size=BATCH, verbose=0)
        arch.cache["baseline"] = ({key: np.array(cap[key]) for key in cap}, out)
    return arch.cache["baseline"]


# --------------------------------------------------------------------------
# a. Points are unique and survive saving
# --------------------------------------------------------------------------
def _snake(name):
    return re.sub(r"(?<!^)(?=[A-Z][a-z])|(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def test_points_are_unique_and_survive_saving(arch, tmp_path):
    model, x = arch.cache["model"], arch.cache["x"]
    points = cs.points(model, x)
    assert not [p for p in points if "@" in p or "#" in p]  # no layer runs twice

    # No two layers make one point, and each layer makes one point (or the
    # elements of one structured output under it).
    by_point, by_layer = _layers_of_points(model, x)
    assert {p: ids for p, ids in by_point.items() if len(ids) > 1} == {}
    own = {}
    for layer, seen in by_layer.values():
        # Several points: the elements of one structured output, under its point.
        parents = set(seen) if len(seen) == 1 else {p.rsplit("/", 1)[0] for p in seen}
        assert len(parents) == 1, (layer.name, sorted(seen))
        (point,) = parents
        # A layer is named by its `name`, unless Keras made the name up (a session
        # counter, different after each load): then by where its parent holds it.
        assert (point == model.name or point.endswith("/" + layer.name)
                or re.fullmatch(_snake(type(layer).__name__) + r"(_\d+)?", layer.name)), \
            (point, layer.name)
        own[point] = layer
    assert len(own) == len(by_layer)
    assert set(points) == set(own) | set(by_point)
    for layer in _top_level(model):
        assert own[f"{model.name}/{layer.name}"] is layer

    # Saved, then loaded twice into this session (two checkpoints side by side). The
    # first load follows conftest's `clear_session` (like a fresh process); the second
    # finds the names Keras generates for unnamed sublayers taken by the first.
    model.save(tmp_path / "m.keras")
    for _ in range(2):
        loaded = cs.enable(keras.saving.load_model(tmp_path / "m.keras"))
        assert loaded.name == model.name
        again = cs.points(loaded, x)
        assert sorted(set(again) ^ set(points)) == []  # the names differing, if any
        assert again == points


# --------------------------------------------------------------------------
# b. A capture of every point matches stock Keras sub-models
# --------------------------------------------------------------------------
def test_capture_of_every_point_matches_stock_keras(arch):
    model, x = arch.cache["model"], arch.cache["x"]
    cap, out = _baseline(arch)
    points = cs.points(model, x)
    # Every tensor point is captured, with all ROWS rows of the uneven batches.
    assert sorted(cap) == sorted(f"{p}:output" for p, s in points.items() if _is_shape(s))
    for point, shape in points.items():
        if _is_shape(shape):
            assert cap[f"{point}:output"].shape == shape, point

    top = _top_level(model)
    stock = keras.Model(model.input, [layer.output for layer in top])
    values = stock.predict(x, batch_size=BATCH, verbose=0)
    assert len(values) == len(top)
    compared = 0
    for layer, value in zip(top, values):
        for key, path in _keys(f"{model.name}/{layer.name}", layer.output):
            _assert_close(cap[key], _at(value, path), key)
            compared += 1
    assert compared >= len(top)
    for key, path in _keys(model.name, out):  # the model's own output
        _assert_close(cap[key], _at(out, path), key)


@pytest.mark.parametrize("arch", ["bert"], indirect=True)
def test_transformer_blocks_have_their_own_weightless_points(arch):
    """Inside the subclassed transformer blocks, each block's dropout layers (no
    weights, so no Keras path of their own) are points of that block, with its values."""
    model, x = arch.cache["model"], arch.cache["x"]
    blocks = [f"{model.name}/transformer_layer_{i}" for i in range(2)]
    by_point, by_layer = _layers_of_points(model, x)
    layer_of = {point: layer for layer, seen in by_layer.values() for point in seen}
    dropouts = [{p[len(block) + 1:]: layer_of[p] for p in by_point
                 if p.startswith(block + "/") and isinstance(layer_of[p], layers.Dropout)}
                for block in blocks]
    for found in dropouts:
        assert len(found) >= 2, found  # after attention and after the feedforward
        assert all(not layer.weights for layer in found.values())
    assert not {id(v) for v in dropouts[0].values()} & {id(v) for v in dropouts[1].values()}

    # Both blocks have the same tree; only Keras's `_<n>` suffixes of automatic
    # names may differ between them.
    def shape_of(names):
        return sorted(re.sub(r"_\d+(?=/|$)", "", name) for name in names)

    assert shape_of(dropouts[0]) == shape_of(dropouts[1])
    # The block's own, explicitly named ones are the same relative points in both.
    named = set(dropouts[0]) & set(dropouts[1])
    assert len(named) >= 2, named

    # Each records its own block's values: in inference a dropout is the identity.
    with cs.capture(model, [b + "/*" for b in blocks], kinds=("input", "output")) as cap:
        model(x, training=False)
    for block, found in zip(blocks, dropouts):
        for name in found:
            point = f"{block}/{name}"
            np.testing.assert_array_equal(cap[f"{point}:output"], cap[f"{point}:input"])
    for name in named:
        first, second = (cap[f"{b}/{name}:output"] for b in blocks)
        assert first.shape == second.shape and _differs(first, second), name


# --------------------------------------------------------------------------
# c. A patch of one block changes only what follows it
# --------------------------------------------------------------------------
def test_patch_of_one_block_changes_only_what_follows(arch):
    model, x = arch.cache["model"], arch.cache["x"]
    before, out = _baseline(arch)
    target = f"{model.name}/{arch.patch}"
    with cs.capture(model, "*") as after, cs.patch(model, {target: keras.ops.zeros_like}):
        patched = model.predict(x, batch_size=BATCH, verbose=0)
    assert sorted(after) == sorted(before)

    top = _top_level(model)
    index = [layer.name for layer in top].index(arch.patch)
    assert 0 < index < len(top) - 1  # a mid-model layer
    unchanged = [key for layer in top[:index]
                 for key, _ in _keys(f"{model.name}/{layer.name}", layer.output)]
    # What runs inside the patched layer ran before its output was replaced.
    unchanged += [key for key in before if key.startswith(target + "/")]
    for key in unchanged:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)

    np.testing.assert_array_equal(after[f"{target}:output"], 0.0)
    assert np.abs(before[f"{target}:output"]).sum() > 0

    if arch.residual is not None:  # the residual branch is zero: the add is the shortcut
        add, shortcut = (f"{model.name}/{name}:output" for name in arch.residual)
        np.testing.assert_array_equal(after[add], before[shortcut])
    if arch.patch == "transformer_layer_0":
        following = f"{model.name}/transformer_layer_1:output"
        assert _differs(before[following], after[following])

    flat_out, flat_patched = keras.tree.flatten(out), keras.tree.flatten(patched)
    for plain, ablated in zip(flat_out, flat_patched):
        assert _differs(plain, ablated)
    for key, path in _keys(model.name, patched):
        np.testing.assert_array_equal(after[key], _at(patched, path), err_msg=key)


def test_a_keras_hub_generate_under_a_capture_or_patch_is_refused():
    # A test dependency, never skipped (not in CI's keras-nightly files: keras_hub
    # 0.32 does not import on a nightly Keras).
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
        max_sequence_length=16, name="gpt2_backbone")
    model = cs.enable(keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None,
                                                    name="lm"))
    model.compile(sampler="greedy")
    prompt = {"token_ids": np.array([[1, 2, 3, 0, 0, 0]] * 2, "int32"),
              "padding_mask": np.array([[1, 1, 1, 0, 0, 0]] * 2, bool)}
    opened = {"A `cs.patch`": lambda: cs.patch(
                  model, {"lm/gpt2_backbone/transformer_layer_0": keras.ops.zeros_like}),
              "A `cs.capture`": lambda: cs.capture(model, "lm/*")}

    def refused():
        for what, opens in opened.items():
            with pytest.raises(RuntimeError, match=what + r" of `lm` is open, and "
                               r"`lm.generate` runs the layers in a loop of its own "
                               r"\(keras_hub's generation loop\), outside any call of the "
                               r"model.* Received: `lm.generate` called inside the scope"):
                with opens():
                    model.generate(prompt, max_length=6, stop_token_ids=None)

    refused()
    stock = model.generate(prompt, max_length=6, stop_token_ids=None)
    assert stock["token_ids"].shape == (2, 6)
    # Its loop, compiled by that call and kept, never calls the layers again: the
    # scopes recorded and patched nothing on JAX and TF, and only warned at exit.
    refused()
    again = model.generate(prompt, max_length=6, stop_token_ids=None)
    np.testing.assert_array_equal(again["token_ids"], stock["token_ids"])
    # A call of the model inside the scope is one, and so is a `generate` of your
    # own that decodes by calling the model.
    with cs.capture(model, "lm/gpt2_backbone") as inside:
        model.predict(prompt, verbose=0)
    assert inside["lm/gpt2_backbone:output"].shape == (2, 6, 8)

    class Decodes(cs.ContextMixin, keras_hub.models.GPT2CausalLM):
        def generate(self, inputs, **kwargs):
            return self(inputs)

    own = Decodes(backbone=backbone, preprocessor=None, name="own")
    with cs.capture(own, "own/gpt2_backbone") as decoded:
        logits = own.generate(prompt)
    np.testing.assert_allclose(decoded["own/gpt2_backbone:output"],
                               inside["lm/gpt2_backbone:output"], rtol=1e-5, atol=1e-6)
    assert logits.shape == (2, 6, 50)
