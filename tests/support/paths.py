"""Where the repository and the tests' data are, wherever a test file sits."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
