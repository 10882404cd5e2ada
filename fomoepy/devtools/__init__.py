"""Developer tools that ship with the package so tests and scripts can import them: test-model makers."""
