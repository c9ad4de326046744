"""Per-request faults for testing the proxy, asked for with the `X-Sim-Fault` request header.

`X-Sim-Fault: cut_after=5` - close the connection after 5 tokens, with no final event
`X-Sim-Fault: stall_after=3:2.5` - after 3 tokens send nothing for 2.5 seconds, then go on
`X-Sim-Fault: error_after=4:out of memory` - after 4 tokens send the dialect's error event
`X-Sim-Fault: status=500` - answer at once with this status and a JSON error body
Several faults are separated by `;` (error messages cannot contain one).
"""

from __future__ import annotations

from dataclasses import dataclass

FAULT_HEADER = "X-Sim-Fault"
MAX_STALL_S = 600.0


class FaultError(ValueError):
    """A malformed X-Sim-Fault header; the message goes into a 400 JSON error body."""


@dataclass(frozen=True, slots=True)
class Faults:
    cut_after: int | None = None
    stall_after: int | None = None
    stall_s: float = 0.0
    error_after: int | None = None
    error_message: str = ""
    status: int | None = None

    @property
    def any(self) -> bool:
        return self != NO_FAULTS


NO_FAULTS = Faults()


def _count(name: str, text: str) -> int:
    if not text.strip().isdigit():
        raise FaultError(f"invalid {FAULT_HEADER} {name}={text!r}: expected a token count (0 or more)")
    return int(text)


def parse_faults(header: str | None) -> Faults:
    """Parse the header's value; an absent or empty header means no faults."""
    if not header or not header.strip():
        return NO_FAULTS
    values: dict[str, object] = {}
    for part in header.split(";"):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep:
            raise FaultError(f"invalid {FAULT_HEADER} {part.strip()!r}: expected NAME=VALUE")
        if name in values or (name == "stall_after" and "stall_s" in values) \
                or (name == "error_after" and "error_message" in values):
            raise FaultError(f"invalid {FAULT_HEADER}: {name} given twice")
        if name == "cut_after":
            values["cut_after"] = _count(name, value)
        elif name == "stall_after":
            count, colon, seconds = value.partition(":")
            try:
                stall = float(seconds)
            except ValueError:
                stall = -1.0
            if not colon or not 0 <= stall <= MAX_STALL_S:
                raise FaultError(f"invalid {FAULT_HEADER} stall_after={value!r}: expected "
                                 f"N:SECONDS with SECONDS from 0 to {MAX_STALL_S:g}")
            values["stall_after"], values["stall_s"] = _count(name, count), stall
        elif name == "error_after":
            count, colon, message = value.partition(":")
            if not colon or not message.strip():
                raise FaultError(f"invalid {FAULT_HEADER} error_after={value!r}: expected N:MESSAGE")
            values["error_after"], values["error_message"] = _count(name, count), message.strip()
        elif name == "status":
            code = _count(name, value)
            if not 400 <= code <= 599:
                raise FaultError(f"invalid {FAULT_HEADER} status={value!r}: expected 400 to 599")
            values["status"] = code
        else:
            raise FaultError(f"unknown {FAULT_HEADER} {name!r}: use cut_after, stall_after, error_after "
                             f"or status")
    return Faults(**values)  # type: ignore[arg-type]
