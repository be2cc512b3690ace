"""Shared fixtures (helpers live in kvtest.py)."""

from __future__ import annotations

import os

import pytest
from kvtest import byte_namespace

from kvpool.keys import Namespace


@pytest.fixture
def ns() -> Namespace:
    return byte_namespace()


@pytest.fixture
def keys() -> list[bytes]:
    return [os.urandom(16) for _ in range(64)]
