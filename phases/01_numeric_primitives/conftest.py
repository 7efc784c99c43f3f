"""Phase 01 fixtures: ``target`` runs a test once per kernel backend present (see primitives_checks.TARGETS)."""
from __future__ import annotations

import pytest

from primitives_checks import TARGETS, Target


@pytest.fixture(params=TARGETS)
def target(request) -> Target:
    return request.param
