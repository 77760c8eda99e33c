"""Launchers: run component specs somewhere. `local` (pdserve up): child processes on this
machine, supervised."""
