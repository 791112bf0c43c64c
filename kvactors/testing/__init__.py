"""Public fakes for testing kvactors (and code built on it) without vendor hardware."""
