"""The Kopf operator, installed as `expertmesh.operator` (setup.py maps the folder).

Run from the repository root with the current directory on sys.path (`python -m pip ...` in a fresh venv), this
folder would be found as the top-level `operator` before the standard library's module, and everything that imports
`collections` would break. Imported under that name, it loads the standard library's module in its place instead
(only modules already loaded at start-up are used here: importlib.util, pathlib and enum would import us again)."""

if __name__ == "operator":
    import os
    import sys
    from importlib.machinery import PathFinder

    _spec = PathFinder.find_spec("operator", [os.path.dirname(os.__file__)])  # os.py lives in the stdlib folder
    _stdlib = type(sys)("operator")
    _stdlib.__spec__, _stdlib.__file__, _stdlib.__loader__ = _spec, _spec.origin, _spec.loader
    sys.modules["operator"] = _stdlib  # the import statement returns what sys.modules holds after this runs
    _spec.loader.exec_module(_stdlib)
