"""Reading the YAML files an operator writes (--config, --api-keys, `deepserve keys`).

A file that does not parse is the operator's to fix, so it is a ValueError naming the file and the line,
which the CLI prints as one `deepserve: error: ...` line (exit 2) instead of a parser traceback.
"""

from __future__ import annotations

from typing import Any

import yaml


def load_yaml(path: str) -> Any:
    """The document in `path` (None for an empty file); ValueError "<path>: not valid YAML (line N: ...)"."""
    with open(path, encoding="utf-8") as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML ({_where(e)})") from None


def _where(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem
