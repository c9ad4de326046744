"""What each inference server is, and how the proxy reads what a server says of itself.

Owns: reading the proxy's own requests' answers from a server whole (`answers`).

Must not import: relay, diagnosis, observers, serve, sweep, simulator.
"""
