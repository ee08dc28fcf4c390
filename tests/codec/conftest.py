"""pytest configuration for the codec tests.

The golden and fuzz inputs are read in place from ``../shared/arrow-testing`` (relative to the repository
root); tests that need them are skipped, naming that directory, when it is absent.
"""

from __future__ import annotations

import pytest
from helpers.codec import ARROW_TESTING


def pytest_report_header(config: pytest.Config) -> str:
    state = "found" if ARROW_TESTING.is_dir() else "MISSING (golden and fuzz tests skipped)"
    return f"codec: arrow-testing data at {ARROW_TESTING}: {state}"
