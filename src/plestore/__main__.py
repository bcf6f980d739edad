"""`python -m plestore` and the `plestore` script: the CLI, with a Ctrl-C while it is still
importing answered as a later one is (one line, exit status 130), not with a traceback."""

import sys


def main() -> int:
    try:
        from plestore.cli import main as cli
    except KeyboardInterrupt:
        print("plestore: interrupted while starting; nothing was changed", file=sys.stderr)
        return 130
    return cli()


if __name__ == "__main__":
    sys.exit(main())
