"""Fixtures shared by kv-serve's tests (their code, typed, is in ``serve_support``)."""

import pytest
from serve_support import serving

#: A factory that starts servers for one test module and stops them when the module ends.
serve = pytest.fixture(scope="module", name="serve")(serving)
