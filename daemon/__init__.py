"""The per-rank transfer daemon, its backends, host swap space and the launcher."""
