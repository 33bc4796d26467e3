"""The one exception type for bad input in the data pipeline.

`str(DataError)` is a single line that names the file, the place in it (line number
or byte offset) when there is one, and what to do about it. Command-line tools print
it as `error: <message>` and exit with status 2.
"""

import argparse
import math


class DataError(Exception):
    """Bad input the user can fix; the message is one line naming file, place and fix."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # force a single line


def finite_float(text: str) -> float:
    """argparse's type for every float flag of megaq's parsers (see ArgumentParser): a
    finite number. `inf` / `nan` (and numbers beyond float range, which parse as inf)
    are refused: a learning rate or weight decay of inf / nan trains to non-finite weights
    and saves them, and no megaq float setting means "unlimited" by inf (leave out
    --exit-duration-in-mins for no time limit; the timeouts exist so that no hang lasts
    forever, so they take large finite values)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number: every float setting "
                                         f"must be finite (no inf or nan); give a finite value")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """megaq's parser: argparse prints a usage block and exits on a bad flag; here error()
    raises `error_class` with one line, `<message> (see --help)`, that the entry point
    prints as its `error:` line (the data tools: DataError through run_cli, exit 2;
    pretrain_gpt.py and the other tools set their own class).

    Every flag declared with ``type=float`` is parsed by :func:`finite_float` (argparse's
    type registry maps ``float`` to it), so that inf and nan are refused once, for every
    float flag of every megaq parser, before any per-flag range check."""

    error_class = DataError

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("type", float, finite_float)

    def error(self, message):
        raise self.error_class(f"{message} (see --help)")


def path_error_line(e: OSError) -> str:
    """`<path>: <reason>; <what to do>` for an OSError about a path the user gave."""
    where = e.filename if e.filename2 is None else f"{e.filename} -> {e.filename2}"
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        fix = "a file stands where a directory is needed; pass another path or move that file"
    elif isinstance(e, PermissionError):
        fix = "pass a path you can write to, or fix its permissions"
    elif isinstance(e, FileNotFoundError):
        fix = "check the path, or create its directory"
    else:
        fix = "pass another path or free the device"
    return f"{where}: {e.strerror or type(e).__name__}; {fix}"


def run_cli(main, argv=None) -> int:
    """Run a tool's `main(argv)`; turn a DataError, or an OSError about a path (an output
    directory blocked by a file, no permission, a full disk), into one stderr line and
    exit code 2. An OSError without a file name is no user mistake: it keeps its
    traceback."""
    import sys

    try:
        main(argv)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.filename is None:
            raise
        print(f"error: {path_error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; no output was written", file=sys.stderr)
        return 130
    return 0
