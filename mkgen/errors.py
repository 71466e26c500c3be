"""Errors mkgen reports to users: one line, naming the field and the fix."""


class MkgenError(Exception):
    """Base of every error the CLI prints as a one-line message (exit 2)."""


class SpecError(MkgenError):
    """An invalid model spec, topology or option."""


def first_line(error: BaseException) -> str:
    """An exception's message cut to its first non-blank line (its type's name when it has
    none): what a one-line error quotes of a library's multi-line one."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
