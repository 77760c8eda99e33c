import pytest

pytestmark = pytest.mark.slow
