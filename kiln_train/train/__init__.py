"""The native SFT run: the trainer and its loop, resume checks, results, the loss routes, the gradient anomaly scan and the adapter canaries (docs/training-profile.md)."""
