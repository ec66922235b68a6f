import os

import pytest

# Triton kernels run on CPU tensors under Triton's interpreter in tests (CI has no GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")


def _serialize_ast_parse() -> None:
    """CPython 3.11 keeps ast.parse's recursion-depth counter in shared module state: two threads parsing at once
    (a server thread formatting a logged traceback, whose carets call ast.parse, while pytest parses a test's
    source to report a failure) raise "SystemError: AST constructor recursion depth mismatch" and abort the whole
    run with an INTERNALERROR. Both callers look ast.parse up at call time, so one lock around it is enough."""
    import ast
    import sys
    import threading

    if sys.version_info >= (3, 12) or getattr(ast.parse, "_serialized", False):
        return
    lock, parse = threading.RLock(), ast.parse

    def serialized_parse(*args, **kwargs):
        with lock:
            return parse(*args, **kwargs)

    serialized_parse._serialized = True
    ast.parse = serialized_parse


_serialize_ast_parse()


@pytest.fixture
def two_threads():
    """torch on two threads for the test (row-invariance must hold with several threads available)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _tree_digest(path) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory):
    """One tiny checkpoint (preset "tiny", seed 0) for the whole session: writing it takes seconds, and most tests
    only read it. Read-only by contract — a test that writes into it fails the session's teardown; copy it
    (`tiny_checkpoint_copy`) to change it, or create your own for another seed or config."""
    from expertmesh.checkpoint.loader import create_checkpoint
    from expertmesh.model.config import preset

    path = create_checkpoint(preset("tiny"), tmp_path_factory.mktemp("shared") / "tiny", seed=0)
    before = _tree_digest(path)
    yield path
    assert _tree_digest(path) == before, f"a test wrote into the shared tiny checkpoint {path}"


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_dir):
    """The shared tiny checkpoint, opened (a validated, lazily read view: safe to share)."""
    from expertmesh.checkpoint.loader import Checkpoint

    return Checkpoint(tiny_checkpoint_dir)


@pytest.fixture(scope="session")
def tiny_checkpoint_copy(tiny_checkpoint_dir):
    """`copy(dest) -> dest`: a private copy of the shared tiny checkpoint, for tests that write into it."""
    import shutil

    def copy(dest):
        shutil.copytree(tiny_checkpoint_dir, dest)
        return dest

    return copy


@pytest.fixture(scope="session")
def api_deployment(tiny_checkpoint_dir, tmp_path_factory):
    """One `expertmesh up`-style deployment on the shared tiny checkpoint for the public-API test files
    (tests/support/api_deployment.py: its settings, key and image hosts), started on first use and stopped at the
    end of the session. Shared: a test must not assert on what other tests leave behind (prefix-cache hits of
    prompts it did not send, server-wide counters other than as differences)."""
    from support.api_deployment import api_deployment

    with api_deployment(tiny_checkpoint_dir, tmp_path_factory.mktemp("api_deployment")) as deployment:
        yield deployment
