"""callscope: context in, intermediates out, for every Keras 3 model.

Custom call arguments (a `debugging` flag, a mode, a temperature) flow from
`fit`, `evaluate`, `predict`, the `*_on_batch` methods and `model(x)` into every
nested layer that declares them, compiled, on the JAX, TensorFlow and PyTorch
backends.

Example:

>>> import keras, numpy as np, callscope as cs
>>> model = cs.enable(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
>>> model.register_context_args("debugging")
>>> with cs.context(debugging=True):
...     _ = model.predict(np.ones((2, 2)), verbose=0)
"""

from callscope import _keras_compat
from callscope._capture import Capture as Capture
from callscope._capture import capture as capture
from callscope._capture import load_capture as load_capture
from callscope._record import collecting as collecting
from callscope._record import emit as emit
from callscope._record import sow as sow
from callscope._scope import StrayValueError as StrayValueError
from callscope._scope import context as context
from callscope._scope import current as current
from callscope._mixin import ContextMixin as ContextMixin
from callscope._grad import IntermediateGrads as IntermediateGrads
from callscope._grad import intermediate_grads as intermediate_grads
from callscope._model import Functional as Functional
from callscope._model import Model as Model
from callscope._model import Sequential as Sequential
from callscope._model import context_args as context_args
from callscope._model import enable as enable
from callscope._patch import patch as patch
from callscope._record import Batch as Batch
from callscope._record import LoopPointError as LoopPointError
from callscope._summary import points as points
from callscope._summary import summary as summary

_keras_compat.mark_made_up_names()  # stable points for unnamed sublayers: see there
_keras_compat.keep_autograph_out()  # TF's autograph leaves callscope's code as it is
_keras_compat.autograph_passes_through(StrayValueError, LoopPointError)  # (their own types)

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Capture",
    "ContextMixin",
    "Functional",
    "IntermediateGrads",
    "LoopPointError",
    "Model",
    "Sequential",
    "StrayValueError",
    "capture",
    "collecting",
    "context",
    "context_args",
    "current",
    "emit",
    "enable",
    "intermediate_grads",
    "load_capture",
    "patch",
    "points",
    "sow",
    "summary",
]
