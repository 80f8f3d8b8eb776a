"""Errors that reach users as one clear line (the CLI prints them without a traceback)."""


class XstageError(Exception):
    """Bad input or an unusable environment; the message names the field and the constraint."""


class InputError(XstageError, ValueError):
    """An argument, file or column violates a stated constraint."""


class CommTimeoutError(XstageError, RuntimeError):
    """A device-side wait ran past its bound; the message names rank, peer and stage."""
