"""Launchers: start the processes of a run (local subprocesses; Ray)."""
