import pytest

from tests.integration.runs import make_synthetic_shards


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """The synthetic shards most integration tests train on (16 px, 4 classes, 320 samples in shards of 40),
    written once per session. Read-only: a test that changes shards writes its own."""
    return make_synthetic_shards(tmp_path_factory.mktemp("data") / "synthetic")
