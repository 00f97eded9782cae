"""Developer tools (tiny checkpoint generation for tests and local runs)."""
