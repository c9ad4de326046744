"""The concurrency sweep: the same request at fixed concurrency steps, and a verdict on what
changed; and the same verdict on live traffic (`live`).

Must not import: relay, serve (records are built by the diagnosis's Recorder, as in the proxy).
"""
