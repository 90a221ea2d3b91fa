"""An argparse parser that answers an unknown flag with the known flags closest to it, as Python 3.14's
`suggest_on_error` does (this project runs on 3.11, whose argparse has none).

    parser = HintingParser(prog="attnserve serve")    # otherwise an argparse.ArgumentParser
    parser.parse_args(["--bundel", "x"])
    # attnserve serve: error: unrecognized arguments: --bundel x (did you mean --bundle?)

Any command's parser can be one; importing it brings nothing but the standard library.
"""

from __future__ import annotations

import argparse
import difflib


class HintingParser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{self.hint(unknown)}")
        return parsed

    def hint(self, unknown: list[str]) -> str:
        """` (did you mean --bundle?)` naming the flag closest to each unknown one (` (--bundel: did you mean
        --bundle?; ...)` for several), or '' when none is close."""
        flags = [option for option in self._option_string_actions if option.startswith("--")]
        hints = {}
        for arg in unknown:
            typed = arg.split("=", 1)[0]  # --bundel=x names the flag --bundel
            close = difflib.get_close_matches(typed, flags, n=1) if typed.startswith("-") else []
            if close:
                hints[typed] = f"did you mean {close[0]}?"
        if len(hints) == 1:
            return f" ({next(iter(hints.values()))})"
        return f" ({'; '.join(f'{typed}: {hint}' for typed, hint in hints.items())})" if hints else ""
