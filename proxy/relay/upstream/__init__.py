"""The proxy's own HTTP/1.1 client to the upstream: a connection that owns its state
(`connection`) and a pool that asks it whether it can carry a request (`pool`)."""
