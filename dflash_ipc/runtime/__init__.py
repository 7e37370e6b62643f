"""Runtime: the supervisor, the run directory, and the scaffold every child process starts from."""
