"""The public API is exactly what `__init__.py` exports, each name documented."""

import inspect

import callscope as cs

PUBLIC = {
    "ContextMixin", "Functional", "Model", "Sequential", "context", "context_args",
    "current", "enable",
}


def test_public_names_are_deliberate():
    assert set(cs.__all__) == PUBLIC
    assert isinstance(cs.__version__, str)


def test_every_public_name_has_a_docstring_with_an_example():
    for name in PUBLIC:
        doc = inspect.getdoc(getattr(cs, name)) or ""
        if name == "ContextMixin":
            doc = inspect.getdoc(cs.ContextMixin.register_context_args)
        assert ">>>" in doc, name


def test_import_does_not_pull_in_other_backends_or_matplotlib():
    import subprocess
    import sys

    code = ("import sys, callscope; print(sorted(m for m in ('matplotlib', 'torch', "
            "'tensorflow', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"KERAS_BACKEND": "jax", "PATH": ""}, check=True)
    assert out.stdout.strip() == "['jax']"
