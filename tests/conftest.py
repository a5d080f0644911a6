"""This project's test harness: its folder and its task's tiny job (``tests/task/tiny_job.py``),
for its own tests and the library's conformance checks (``tests/test_conformance.py``). The
fixtures and the daily-set convention come from :mod:`lightning_exact.testing.plugin`."""

from pathlib import Path

import pytest
from lightning_exact.testing.harness import Harness, load_tiny_job

pytest_plugins = ["lightning_exact.testing.plugin"]

PROJECT = Path(__file__).resolve().parents[1]
HARNESS = Harness(PROJECT, load_tiny_job(PROJECT / "tests" / "task" / "tiny_job.py"))


@pytest.fixture(scope="session")
def harness() -> Harness:
    return HARNESS
