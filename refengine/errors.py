"""The one exception type for mistakes a user can make (bad file, unsupported architecture or
quant type, prompt longer than the context, ...). The CLI prints its message on one line and exits
non-zero; everything else is a bug and keeps its traceback."""


class UserError(Exception):
    """A mistake the user can fix; the message says what to do."""
