"""The one exception type that the CLI turns into a one-line message and exit code 1."""


class MtrainError(Exception):
    """A user-facing error: the message names the problem (file, line) and the fix.

    The CLI prints ``error: <message>`` on stderr and exits with code 1, with no traceback.
    Raise it for anything a user can fix (bad input, bad config); let real bugs propagate.
    """
