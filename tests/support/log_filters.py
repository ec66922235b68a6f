"""Logger filters for tests that drive a server into its error paths."""

import logging


class ErrorSignatures(logging.Filter):
    """Drops the server's logged exceptions (keeping `Type: message` of each) so that no thread formats their
    tracebacks: CPython 3.11's traceback carets call ast.parse, whose recursion guard is not thread-safe, and a
    server thread formatting one while pytest parses a test's source raises "SystemError: AST constructor
    recursion depth mismatch" (an INTERNALERROR). A logger filter, as pytest attaches its capture handlers to
    every logger; the 5xx themselves are asserted through the responses."""

    LOGGERS = ("uvicorn.error", "expertmesh.router", "grpc._server")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def filter(self, record) -> bool:
        if not record.exc_info:
            return True
        e = record.exc_info[1]
        self.seen.append(f"{type(e).__name__}: {e}")
        return False

    def install(self) -> "ErrorSignatures":
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def uninstall(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)
