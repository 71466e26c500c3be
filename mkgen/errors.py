"""Errors mkgen reports to users: one line, naming the field and the fix."""


class MkgenError(Exception):
    """Base of every error the CLI prints as a one-line message (exit 2)."""


class SpecError(MkgenError):
    """An invalid model spec, topology or option."""
