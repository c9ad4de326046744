"""Moves bytes between clients and the upstream: unchanged, at once, bounded.

Owns: the proxy port's handler (`forward`), request bodies (`request_body`), deadlines, the
in-flight count (`in_flight`), the listeners, HTTP/1.1 framing as pure functions (`http1`), and
the upstream connections and their pool (`upstream/`). It knows nothing of Prometheus, NVML,
dialects or classification: it tells the diagnosis's Recorder what happened, and makes one call
when an exchange ends (`proxy.diagnosis.finish.Finisher`).

Must not import: serve, sweep, simulator, nor any observer.
"""
