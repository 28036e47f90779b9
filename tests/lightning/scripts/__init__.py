"""Scripts that the Lightning tests run as separate processes."""
