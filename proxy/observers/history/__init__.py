"""History: every record in a database that outlives the process.

Owns: the writer, an observer with a thread and a bounded buffer of its own (`writer`); one
interface for the databases (`backend`) and a module each: the embedded SQLite file, the default,
one per proxy (`sqlite`), and PostgreSQL, one for a fleet (`postgres`); where a history is and how
it is shown without its password (`source`).

Must not import: relay, diagnosis, serve, sweep, simulator.
"""

from proxy.observers.history.backend import HistoryError, HistoryReadError
from proxy.observers.history.source import HistorySource, default_path, history_files, parse_history
from proxy.observers.history.writer import History

__all__ = ["History", "HistoryError", "HistoryReadError", "HistorySource", "default_path", "history_files",
           "parse_history"]
