"""`fomoe plan`: projected decode speed from a model's exact bytes, routing hit rates and stated
hardware figures, following the engine's own schedule (or FOMOE's, for comparison).

shapes -> hardware -> routing -> timemodel -> report, with commands.py as the CLI seam."""
