"""gradtape's own error types: what a user can cause, reported as one clear line."""


class GradtapeError(Exception):
    """A problem with the user's input (a file, an option, data); the CLI prints it plainly."""


class FileFormatError(GradtapeError, ValueError):
    """A model, adapter or data file is malformed, truncated or unsupported."""
