"""The one kind of error a recipe shows its user: a single line that says what to do."""


class UserError(Exception):
    """A problem the user can fix (a flag, a path, a data file): printed as one line."""
