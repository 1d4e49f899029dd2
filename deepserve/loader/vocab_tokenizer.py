"""A tokenizer that covers a shape preset's whole vocabulary, for serving it with dummy weights.

`deepserve serve PRESET --load-format dummy` has no checkpoint and so no tokenizer; the HTTP server
needs one (chat templates, text out). This one is byte-level: the 256 byte tokens encode any text
(no merges, so one token per byte), every other id up to vocab_size decodes to a distinct word
(" t<id>"), and bos/eos sit at the preset's own ids, so the engine stops where the real model would.
Random weights then produce text, and `bench serve` (token-id prompts) measures the real shapes.
It is written once per preset into DEEPSERVE_CACHE_DIR/tokenizers/ and reused.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

VERSION = "v1"  # bump when the written bytes change


def _special_ids(hf_config: Any) -> tuple[int, int]:
    eos = hf_config.eos_token_id
    eos = eos[0] if isinstance(eos, list | tuple) else eos
    bos = hf_config.bos_token_id
    return (eos if bos is None else bos), eos


def build_vocab_tokenizer(hf_config: Any):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from deepserve.demo import BOS, EOS

    size = hf_config.vocab_size
    bos_id, eos_id = _special_ids(hf_config)
    if not (0 <= bos_id < size and 0 <= eos_id < size) or size < 260:
        raise ValueError(f"cannot build a tokenizer for vocab_size {size} with bos {bos_id} and eos {eos_id}")
    specials = {bos_id: BOS, eos_id: EOS} if bos_id != eos_id else {eos_id: EOS}  # Qwen: bos is eos
    bos = specials[bos_id]
    free = (i for i in range(size) if i not in specials)
    vocab = {ch: next(free) for ch in sorted(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({f"Ġt{i}": i for i in free})  # "Ġ" is the byte-level space: decodes to " t<id>"
    vocab.update({tok: i for i, tok in specials.items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(sorted(set(specials.values())))
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=EOS,
                                   clean_up_tokenization_spaces=False)


def vocab_tokenizer_dir(name: str, hf_config: Any) -> str:
    """The folder of `name`'s tokenizer (written on first use); pass it as --tokenizer."""
    from deepserve import envs
    from deepserve.demo import CHAT_TEMPLATE, EOS

    bos_id, eos_id = _special_ids(hf_config)
    path = os.path.join(envs.DEEPSERVE_CACHE_DIR, "tokenizers",
                        f"{name}-{hf_config.vocab_size}-{bos_id}-{eos_id}-{VERSION}")
    if os.path.exists(os.path.join(path, "tokenizer_config.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(path))
    tok = build_vocab_tokenizer(hf_config)
    tok.backend_tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": EOS,
              "pad_token": EOS,
              "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": hf_config.max_position_embeddings, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    try:
        os.rename(tmp, path)  # atomic: a concurrent writer's folder wins, ours is dropped
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path
