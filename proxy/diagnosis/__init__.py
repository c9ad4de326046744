"""Events to the one record, and the only writer of a record's fields.

Owns: the Recorder (each exchange's record, fed by the relay and the sweep alike), the stream
tally, the classification of why a response ended (`classify`), what the prompt's size proves
(`prompt_rules`, each server's rules asked of its module), what only the server can still say
after a response (`server_check`, with its bounded `tokenizer_queue`), the one call the relay
makes when an exchange ends (`finish`), and the delivery of a finished record to the observers,
what the enrichers know written in first (`delivery`).

Must not import: relay, serve, sweep, simulator (wire, servers, observers, record, config below it
are fine).
"""
