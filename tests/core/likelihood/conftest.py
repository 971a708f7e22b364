"""Fixtures of the likelihood tests: the bidirectional Llama toys of :mod:`.toys`."""

import pytest

from .toys import _llama


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def llama_independent():
    return _llama(zero_o_proj=True)
