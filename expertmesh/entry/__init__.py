"""Composition roots beside the CLI (`expertmesh/cli.py`, `expertmesh/up.py`): the only core modules that import
the roles (router/, worker/, operator/), which never import each other."""
