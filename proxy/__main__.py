"""`python -m proxy` runs the same CLI as the `llm-diag-proxy` console script."""

from proxy.serve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
