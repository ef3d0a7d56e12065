"""`python -m eagleserve ...` is the `eagleserve` command."""

from __future__ import annotations

from eagleserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
