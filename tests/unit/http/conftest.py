from __future__ import annotations

import pytest
from http_fakes import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()
