"""The public API is exactly what `__init__.py` exports, each name documented."""

import inspect

import callscope as cs

PUBLIC = {
    "Batch", "Capture", "LoopPointError", "ContextMixin", "Functional", "Model", "Sequential",
    "StrayValueError",
    "capture", "collecting", "load_capture",
    "context", "context_args", "current", "emit", "enable", "intermediate_grads",
    "IntermediateGrads", "patch", "points", "sow", "summary",
}


def test_public_names_are_deliberate():
    assert set(cs.__all__) == PUBLIC
    assert isinstance(cs.__version__, str)


def test_every_public_name_has_a_docstring_with_an_example():
    for name in PUBLIC:
        doc = inspect.getdoc(getattr(cs, name)) or ""
        if name == "ContextMixin":
            doc = inspect.getdoc(cs.ContextMixin.register_context_args)
        if name == "IntermediateGrads":
            doc = inspect.getdoc(cs.intermediate_grads)
        if name == "Capture":
            doc = inspect.getdoc(cs.capture)
        assert ">>>" in doc, name


def test_import_adds_no_backend_or_matplotlib_beyond_keras_own():
    import subprocess
    import sys

    def heavy_modules(statement):
        code = (f"import sys; {statement}; print(sorted(m for m in ('matplotlib', 'torch', "
                "'tensorflow', 'jax') if m in sys.modules))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={"KERAS_BACKEND": "jax", "PATH": ""}, check=True)
        return out.stdout.strip()

    assert "'jax'" in heavy_modules("import callscope")
    assert heavy_modules("import callscope") == heavy_modules("import keras")
