"""Shared test helpers. Each backend runs the whole suite in its own process."""

import gc
import os

import keras
import numpy as np
import pytest

BACKEND = keras.backend.backend()
# Scripts run in processes of their own (device counts are fixed per process).
collect_ignore = ["distributed_worker.py", "multiprocess_worker.py", "sharded_worker.py",
                  "sow_axes_worker.py"]


def pytest_configure(config):
    expected = os.environ.get("KERAS_BACKEND")
    if expected and expected != BACKEND:
        raise pytest.UsageError(
            f"KERAS_BACKEND={expected} but keras imported the {BACKEND} backend"
        )


@pytest.fixture(autouse=True, scope="module")
def _release_frozen_objects():
    # What `_clean_session` froze during a module is handed back to the collector
    # when the module ends, so objects that die through cycles (module-scoped
    # fixtures' models) are freed by the next module's first collection.
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _clean_session():
    keras.utils.clear_session()
    # clear_session ends in a full collection, whose cost grows with the heap:
    # late in a run it took 1.5 s a test on torch. Freezing what survives it
    # means each later collection scans only the objects made since.
    gc.freeze()
    keras.utils.set_random_seed(0)
    yield


class TraceCounter:
    """Counts Python executions of a layer's `call`.

    Under JAX and TensorFlow compiled steps, `call` runs in Python once per trace,
    so this counts traces. Torch runs eagerly (each step is a Python call), so
    the count there is per step and tests compare `make_*_function` builds instead.
    """

    def __init__(self):
        self.count = 0


def traces_are_python_calls(jit_compile):
    return BACKEND in ("jax", "tensorflow") and jit_compile is not False


def numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))
