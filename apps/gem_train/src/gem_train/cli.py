"""Command line of the reference trainer."""

import sys


def main(argv: list[str] | None = None) -> int:
    print(
        "gem-train: the reference trainer is not built yet; see the project's issues.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
