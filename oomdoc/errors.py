"""Errors that end oomdoc with a one-line message and exit status 2."""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""
