"""One job each with a finished record.

Owns: the chain and the Observer and Enricher protocols (`chain`), the Prometheus metrics, the
JSON log line (`logs`), the in-memory record store (`record_store`), the SQLite history, the
OpenTelemetry spans (`tracing`), and the GPU and upstream-server telemetry (`telemetry/`). An
observer reads a record; it never writes one (an enricher returns facts that the diagnosis
writes).

Must not import: relay, diagnosis, serve, sweep, simulator (wire only for what servers say of
themselves).
"""
