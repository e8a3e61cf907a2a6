"""Plain shared types and leaf helpers every Kiln package may import: byte units, the forward batch and its
attention metadata, graph shape lists, environment variables, logging. Imports nothing else of Kiln."""
