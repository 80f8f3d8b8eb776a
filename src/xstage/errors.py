"""Errors that reach users as one clear line (the CLI prints them without a traceback).

Their message is one line by construction: a line end or other control character it quotes from the
input (a path, a cell, a command-line word) is written as its escape (`one_line`).
"""


def one_line(text) -> str:
    """`text` as one line: each character that is not printable (line ends, tabs, form feeds, the
    terminal's controls) written as its Python escape, so that no quoted input splits a refusal or
    rewrites the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


class XstageError(Exception):
    """Bad input or an unusable environment; the message names the field and the constraint."""

    def __init__(self, message="", *args):
        super().__init__(one_line(message), *args)


class InputError(XstageError, ValueError):
    """An argument, file or column violates a stated constraint."""


class CommTimeoutError(XstageError, RuntimeError):
    """A device-side wait ran past its bound; the message names rank, peer and stage."""
