"""Reading the YAML files an operator writes (--config, --api-keys, `deepserve keys`).

A file that does not parse is the operator's to fix, so it is a ValueError naming the file and the line,
which the CLI prints as one `deepserve: error: ...` line (exit 2) instead of a parser traceback. So is a
file that is not UTF-8 text, or cannot be read (missing, a directory, no permission).
"""

from __future__ import annotations

from typing import Any

import yaml


def load_yaml(path: str) -> Any:
    """The document in `path` (None for an empty file); ValueError "<path>: not valid YAML (line N: ...)",
    "<path>: not UTF-8 text (...)" or "<path>: <why it cannot be read>"."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")  # whole, so a decoding error's offset is the file's
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({_where(e)})") from None


def _where(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem
