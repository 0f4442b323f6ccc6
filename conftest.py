"""Root pytest configuration: each backend's gradient module imports its own
framework, so the doctest collection skips the two modules of the backends this
process does not run (the tests themselves run once per backend)."""

import keras

collect_ignore = [f"src/callscope/_grads/{name}.py" for name in ("jax", "tensorflow", "torch")
                  if name != keras.backend.backend()]
