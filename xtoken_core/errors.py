"""What kind of failure an error is, decided where the check is made: bad settings or bad data.

A process that raises one of these exits with the code its class names (the process lifecycle,
``services.common.lifecycle``), and its supervisor does not restart it: the same settings or the
same data fail the same way again. Any other error is a fault (exit code 1), which a restart may
cure: a run's own file read mid-run that is damaged or being replaced, a peer that went away.

Both are ``ValueError`` subclasses, so callers that catch ``ValueError`` keep working.
"""

from __future__ import annotations

__all__ = ["EXIT_DATA", "EXIT_SETTINGS", "DataError", "SettingsError"]

# the exit code of a process that stops on bad settings (services.common.lifecycle)
EXIT_SETTINGS = 2
# the exit code of a process that stops on bad data
EXIT_DATA = 3


class SettingsError(ValueError):
    """A setting that cannot work (a value out of range, a file or model that a setting names and
    that does not exist, two settings that do not go together). The message names the setting and
    the fix; a process exits with :data:`EXIT_SETTINGS` and is not restarted."""


class DataError(ValueError):
    """Input data that cannot be used as given (a corpus without text, a line that does not
    parse). The message names the file (and line) and the fix; a process exits with
    :data:`EXIT_DATA` and is not restarted."""
