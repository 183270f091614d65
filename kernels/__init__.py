"""The data plane's Triton kernels: the package ``twinplane.kernels``.

This folder sits at the root of a checkout, so whenever that root is on ``sys.path`` (the tests,
``python -m`` run there) it is also found as a top-level package named ``kernels``: the name of
Hugging Face's kernels package, which transformers imports when it is installed. Imported under
that name, this module hands the import over to that package where one is installed. Where none
is, it stays this folder, with no version: transformers (which imports a ``kernels`` it finds
without package metadata to read its version) then takes it for no kernels package at all.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # what the import statement returns once this module has run
        _spec.loader.exec_module(_module)
