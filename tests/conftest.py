"""Test-wide settings: JAX runs on the CPU (libtpu is installed for compile-only devices)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
