"""Tokenizer, eos ids and chat template of a local Hugging Face checkpoint folder.

Nothing here downloads: `path` is a folder on disk (the CLI resolves hub names before this).
Remote code is never run, so a checkpoint that ships only a custom Python tokenizer fails with a
clear message instead of executing it.

A chat template usually begins with the bos token itself, so encode its output with
add_special_tokens=False or the prompt starts with bos twice.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from deepserve.errors import FilesMissing

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Any one of these lets AutoTokenizer build a tokenizer without remote code.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "tekken.json")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FilesMissing(f"tokenizer folder {path!r} does not exist; pass a local model folder")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise FilesMissing(
            f"no tokenizer files in {path!r} (expected one of {', '.join(_TOKENIZER_FILES)}); "
            "use the folder of the original Hugging Face checkpoint, which ships them"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load the tokenizer in {path!r}: {e}") from e
    _quiet_length_warning(tokenizer)
    return tokenizer


# transformers' key for the one-time "Token indices sequence length is longer than the specified maximum
# sequence length" warning (tokenization_utils_base._eventual_warn_about_too_long_sequence).
_TOO_LONG_WARNING = "sequence-length-is-longer-than-the-specified-maximum"


def _quiet_length_warning(tokenizer: Any) -> None:
    """Mark transformers' too-long-sequence warning as already given. Its limit is tokenizer_config.json's
    model_max_length, not the engine's max_model_len, and the engine refuses a prompt too long for the
    context itself with the OpenAI-style "maximum context length" error: the warning printed before that
    error, and before prompts the engine accepts when max_model_len is larger. Only this one warning is
    silenced; the tokenizer's other warnings and the library's log level stay as they are."""
    given = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(given, dict):
        given[_TOO_LONG_WARNING] = True


def load_eos_token_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    """Every id that ends generation: generation_config.json's eos_token_id (an int or a list, as
    DeepSeek and Llama-3 checkpoints write it) together with the tokenizer's eos token."""
    ids: set[int] = set()
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            try:
                eos = json.load(f).get("eos_token_id")
            except json.JSONDecodeError as e:
                raise ValueError(f"{gen_path} is not valid JSON: {e}") from e
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(i) for i in eos)
        elif eos is not None:
            raise ValueError(f"{gen_path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def apply_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Render `messages` to the prompt text; extra kwargs reach the template (e.g. tools, thinking)."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "this checkpoint"
        raise ValueError(
            f"the checkpoint {name!r} has no chat template; send a plain prompt to the completions "
            "endpoint instead, or use a checkpoint whose tokenizer_config.json has a chat_template"
        )
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
