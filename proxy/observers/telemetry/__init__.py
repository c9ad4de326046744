"""Correlates every response with GPU memory (NVML) and the upstream server's own state."""

from proxy.observers.telemetry.service import Telemetry

__all__ = ["Telemetry"]
