"""User-facing errors: one line, naming the offending file, key or value."""


class UserError(Exception):
    """A mistake in the user's input (recipe, checkpoint, prompt). The CLI prints it as one line."""
