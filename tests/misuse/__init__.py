"""Bad input at every front door: a clear, typed error, or the right result."""
