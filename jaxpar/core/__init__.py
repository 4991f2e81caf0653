"""The core: mesh, logical rules, the Plan and its option checks, the one trace context. Imports nothing of jaxpar."""
