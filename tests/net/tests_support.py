"""Shared bits of the network tests."""

from __future__ import annotations

import os

KEYS = [os.urandom(16) for _ in range(16)]
