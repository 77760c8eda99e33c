import pytest

from tests.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
