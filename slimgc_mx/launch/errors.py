"""The launcher's two failures, below every module that raises them."""


class LaunchError(Exception):
    """A problem with the options or the environment, reported as a usage error (exit 2)."""


class StartError(Exception):
    """A task's command could not be started at all (exit 127, as a shell does)."""
