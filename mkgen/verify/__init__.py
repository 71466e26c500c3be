"""Proving a generated kernel without a TPU: interpret-mode numerics and TPU7x compiles."""
