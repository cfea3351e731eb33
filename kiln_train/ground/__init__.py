"""The ground of kiln_train (docs/ARCHITECTURE.md#packages): facts and primitives every folder
stands on and that import nothing of kiln_train but `errors`: SHA-256 digests and canonical JSON
(`digest.py`), the backend facts fixed at worker start (`backend.py`), durable file writes and
the no-replace rename (`durable_files.py`), how layers are cut into gradient-checkpoint segments
(`layer_segments.py`), the largest model dimensions anything accepts (`limits.py`), and the
near misses a refusal names (`near_miss.py`).
Torch-free."""
