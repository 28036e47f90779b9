"""Lightning integration tests."""
