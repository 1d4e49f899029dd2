"""The help formatter of deepserve's commands: argparse's ArgumentDefaultsHelpFormatter, except that a
help text which already says its default ("(default: the model's)") keeps its own words instead of
getting a second, literal "(default: None)" appended."""

from __future__ import annotations

import argparse
import re

_SAYS_DEFAULT = re.compile(r"\bdefault:", re.IGNORECASE)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if _SAYS_DEFAULT.search(text):
            return text
        return super()._get_help_string(action)
