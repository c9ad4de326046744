"""The concurrency sweep: the same request at fixed concurrency steps, and a verdict on what changed."""
