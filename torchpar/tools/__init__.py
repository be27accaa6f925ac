"""Tools beside the trainer: schedule pictures, the communication ledger, the shape-only build."""
