"""Reading a command line as every tool and train.py read it: options first, then config overrides
(``KEY VALUE`` / ``KEY=VALUE``), and one ``error:`` line with exit status 2 for a bad one.

Every tool starts the same way: its ``main(argv)`` is wrapped by gnetmdk.engine.cli.tool_main (the
command line from ``sys.argv`` when none is given; a user error as one ``error:`` line and exit status
2) and the script ends with ``sys.exit(main())``. The tools import the installed package
(``pip install -e .``)."""
from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """argparse with this project's one-line refusals: a bad option prints ``error: ...`` (naming the
    option, the value and the fix) and exits with status 2, without the usage block."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        """Print ``error: <message> (<prog> --help lists the options)`` to stderr and exit with status 2.

        Raises:
            SystemExit: always, with code 2.
        """
        print(f"error: {message} ({self.prog} --help lists the options)", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def parse_with_overrides(self, argv):
        """Parse ``argv`` as the tools and train.py read a command line: options and positionals first,
        then config overrides (``KEY VALUE`` or ``KEY=VALUE``). The overrides start at the first word that
        is a config field name or holds "=" and is not the value of an option that takes one (an option
        with an optional value, such as ``--check``, never takes an override word), so an override is
        never read as a path. Words left over at the end of the options (``no_such_field 1``) are
        overrides too, for the config to refuse by name.

        Returns:
            (argparse.Namespace, [override words]).
        Raises:
            SystemExit(2): one ``error:`` line for a bad option, or an option written after the overrides.
        """
        from gnetmdk.config.overrides import override_names
        fields = override_names()
        takes_value = {o for a in self._actions if a.option_strings and a.nargs is None
                       and not isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                              argparse._HelpAction, argparse._VersionAction,
                                              argparse._CountAction, argparse._StoreConstAction))
                       for o in a.option_strings}
        argv = list(argv)
        cut = len(argv)
        for i, tok in enumerate(argv):
            if tok.startswith("-") or (i and argv[i - 1] in takes_value):
                continue
            if "=" in tok or tok.replace("-", "_") in fields:
                cut = i
                break
        options, overrides = argv[:cut], argv[cut:]
        late = [t for t in overrides if t.startswith("--")]
        if late:
            self.error(f"option {late[0]} comes after the config overrides; write options first, then KEY VALUE "
                       "overrides")
        args, extra = self.parse_known_args(options)
        if extra and extra == options[len(options) - len(extra):] and not any(t.startswith("-") for t in extra):
            # words after the options that are no field name: overrides still, refused by the config
            # with its own line (the field named, the nearest field suggested), not as a stray argument
            return args, extra + overrides
        return self.parse_args(options), overrides


def at_least(low: int):
    """argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        return v
    return parse


def fraction(low_open: bool = False, high_open: bool = False):
    """argparse type: a number in [0, 1] (``low_open``: above 0; ``high_open``: below 1), e.g. a score,
    an IoU threshold or an mAP difference."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ((0 < v if low_open else 0 <= v) and (v < 1 if high_open else v <= 1)):
            raise argparse.ArgumentTypeError(f"must be in {'(0' if low_open else '[0'}, {'1)' if high_open else '1]'}, "
                                             f"got {v:g}")
        return v
    return parse


def parse_with_overrides(parser, argv):
    """``parser.parse_known_args``: the left-over words are config overrides (KEY VALUE / KEY=VALUE);
    an unknown ``--option`` among them is refused through ``parser.error`` (exit 2)."""
    args, rest = parser.parse_known_args(argv)
    bad = [t for t in rest if t.startswith("--")]
    if bad:
        parser.error(f"unrecognised option {bad[0]} (config overrides are written KEY VALUE or KEY=VALUE)")
    return args, rest


def fail(msg: str, code: int = 2) -> int:
    """Print ``error: msg`` on stderr; return ``code`` (for ``return fail(...)`` in a main())."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return code
