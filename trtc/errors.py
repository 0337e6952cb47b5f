"""Errors a user sees: one line that says what is wrong and how to fix it."""


class TrtcError(Exception):
    """Base of all errors trtc reports without a traceback."""

    exit_code = 1


class ConfigError(TrtcError):
    """The build config (or a command-line value) is invalid."""

    exit_code = 2


class BuildError(TrtcError):
    """A build stage failed on valid input (unsupported model, unfused attention, ...)."""


class ArtifactError(TrtcError):
    """An artifact directory is missing, incomplete, tampered with or too new."""
