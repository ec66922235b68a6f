"""The chart rendered once per value set (tests/support/helm.py's VALUE_SETS), for the tests that check every one."""

import pytest
from support.helm import VALUE_SETS, render


@pytest.fixture(params=sorted(VALUE_SETS), ids=str)
def rendered(request) -> tuple[str, dict, list[dict]]:
    values, release = VALUE_SETS[request.param]
    return request.param, values, render(values, release)
