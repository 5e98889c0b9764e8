import pytest
from fake_openai import FakeOpenAI, Served  # tests/loadtest is on sys.path under pytest (rootdir-less folder)


@pytest.fixture
def fake():
    f = FakeOpenAI()
    with Served(f) as s:
        f.url = s.url
        yield f
