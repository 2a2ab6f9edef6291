"""Shared fixtures. The environment is set before Prefect is imported anywhere."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="assay-prefect-"))
for key, value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}.items():
    os.environ.setdefault(key, value)

from corpus import make_bad_corpus  # noqa: E402  (after the environment is set)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API for every flow test in the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="module")
def cli_on_session_api(prefect_harness):
    """`assay` commands a module runs use the session's Prefect API (the child processes inherit
    PREFECT_API_URL), as a user's do with `assay ui` running; each would otherwise start a temporary
    server of its own, 5-10 s apiece. Tests of that temporary server pass their own environment."""
    from prefect.settings import PREFECT_API_URL

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())
        yield


@pytest.fixture
def bad_corpus(tmp_path: Path) -> dict[str, Path]:
    return make_bad_corpus(tmp_path)
