"""The history writer: records per second it sustains, and what `on_response` costs the event loop.

Pushes N records (the size of a real streamed answer's record) through `History.on_response` as
fast as a loop could hand them over, then waits until the writer thread has committed them all.

    python benchmarks/history.py            # 50,000 records into a fresh database in /tmp
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.request_cost import record
from proxy.observers.history import History


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=50_000)
    args = parser.parse_args()
    records = [record(i).record for i in range(args.n)]
    with tempfile.TemporaryDirectory() as tmp:
        history = History(str(Path(tmp) / "history.sqlite3"), max_age_s=0, max_bytes=0)
        history.open()
        started = time.perf_counter()
        cpu = time.process_time()
        handed = 0.0
        for chunk in range(0, args.n, 1000):  # in bursts, as a loop hands them over between other work
            t0 = time.perf_counter()
            for item in records[chunk:chunk + 1000]:
                history.on_response(item)
            handed += time.perf_counter() - t0
            time.sleep(0.001)
        while history.written + history.dropped < args.n:
            time.sleep(0.01)
        elapsed = time.perf_counter() - started
        history.close()
        size = history.size_bytes()
    print(f"# {time.strftime('%Y-%m-%d')}: {args.n} records, {history.dropped} dropped; writer sustained "
          f"{history.written / elapsed:,.0f} records/s ({elapsed:.2f} s wall, {time.process_time() - cpu:.2f} s CPU "
          f"in all); on_response {handed / args.n * 1e6:.1f} us per record on the caller; "
          f"{size / max(1, history.written):,.0f} bytes per record on disk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
