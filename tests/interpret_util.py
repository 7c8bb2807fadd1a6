"""Marks for the tests that run Triton kernels through its CPU interpreter: Triton must be installed,
and TRITON_INTERPRET=1 must be set before triton is first imported (tests/conftest.py sets it on
machines without CUDA; where CUDA is present the tests under tests/gpu check the compiled kernels)."""

from __future__ import annotations

import importlib.util
import os

import pytest

INTERPRETED = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="needs TRITON_INTERPRET=1 before triton is imported (CUDA machines: see tests/gpu)",
    ),
]
