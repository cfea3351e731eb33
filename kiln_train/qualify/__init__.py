"""Hardware qualification workloads that produce committed receipts (qualification/README.md)."""
