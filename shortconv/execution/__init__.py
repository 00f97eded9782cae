"""Model execution on one rank: runner, step inputs, backend metadata, graphs."""
