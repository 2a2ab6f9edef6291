"""The one exception type that the CLI turns into a one-line message."""


class AssayError(Exception):
    """An error the user can act on: bad arguments, missing inputs, bad config.

    The CLI prints it as a single line and exits non-zero; any other
    exception is a bug and gets a traceback only under --debug.
    """
