"""Composition roots beside the CLI (`expertmesh/entry/cli.py`, `expertmesh/entry/up.py`): the only core modules that import
the roles (router/, worker/, operator/), which never import each other."""
