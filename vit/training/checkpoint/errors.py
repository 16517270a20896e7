"""The one error a checkpoint that cannot be used raises, whichever door opened it."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, unreadable, malformed, or made for another model.

    Its message is one line that names the file (or URL, redacted) and the key or value at fault.
    """
