"""Fixtures; the shared helpers (and the switch to Triton's CPU interpreter) are in tests/helpers.py."""

import pytest

from tests.helpers import BACKENDS


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param
