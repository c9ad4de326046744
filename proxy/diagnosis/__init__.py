"""Events to the one record, and the only writer of a record's fields.

Owns: the Recorder (each exchange's record, fed by the relay and the sweep alike), the stream
tally, the classification of why a response ended (`classify`), what the prompt's size proves
(`prompt_rules`), what only the server can still say after a response (`server_check`,
`server_reads`), and the delivery of a finished record to the observers, enrichers' facts
written in first (`delivery`).

Must not import: relay, serve, sweep, simulator (wire, observers, record, config below it are
fine).
"""
