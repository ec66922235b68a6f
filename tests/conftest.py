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
