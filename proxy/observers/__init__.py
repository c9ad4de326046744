"""One job each with a finished record.

Owns: the Observer and Enricher protocols (`hooks`), the Prometheus metrics (`metrics`; the
workers' registries summed: `metrics_merge`), the JSON log line (`logs`), the in-memory record
store (`record_store`), the history (`history/`: SQLite or PostgreSQL), the OpenTelemetry spans
(`tracing`), and the GPU and upstream-server telemetry (`telemetry/`). An observer reads a record;
it never writes one (an enricher returns what it knows of the response's time, which the
diagnosis writes).

Must not import: relay, diagnosis, serve, sweep, simulator (servers only for what each server is).
"""
