"""The one exception type for bad input in the data pipeline.

`str(DataError)` is a single line that names the file, the place in it (line number
or byte offset) when there is one, and what to do about it. Command-line tools print
it as `error: <message>` and exit with status 2.
"""


class DataError(Exception):
    """Bad input the user can fix; the message is one line naming file, place and fix."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # force a single line


def run_cli(main, argv=None) -> int:
    """Run a tool's `main(argv)`; turn a DataError into one stderr line and exit code 2."""
    import sys

    try:
        main(argv)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; no output was written", file=sys.stderr)
        return 130
    return 0
