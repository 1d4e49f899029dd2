"""The built-in tiny demo model: what a command runs when it is given no model.

A random-weight DeepSeek-V3-architecture checkpoint — multi-head latent attention and a routed
mixture of experts, in miniature — (so its text is gibberish) with a real byte-level BPE
tokenizer and a DeepSeek-style chat template. It exercises every stage of serving — tokenize, chat
template, prefill, decode, detokenize, stop — on any CPU in seconds, and it is written locally:
nothing is downloaded. Writing it is deterministic, byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from deepserve import envs
from deepserve.chat_markup import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    END_THINK,
    OUTPUT_BEGIN,
    OUTPUT_END,
    OUTPUTS_BEGIN,
    OUTPUTS_END,
    SEP,
    THINK,
    TOOL_MARKERS,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]
# DeepSeek-V3's tool-call and tool-result markers and R1's thinking tags, each one token as in DeepSeek's
# tokenizers. Added after training as non-special tokens, so they stay in the decoded text (the tool-call
# and reasoning parsers read them there) whatever skip_special_tokens says.
MARKER_TOKENS = [*TOOL_MARKERS, THINK, END_THINK]
VOCAB_SIZE = 1000
# Bump the suffix whenever the written bytes change, so stale caches are not reused.
CACHE_NAME = "demo-model-v5"
# DeepSeek-V3's multi-token-prediction layer (num_nextn_predict_layers = 1), random like the rest, so
# speculative_config method "mtp" runs on the demo; in a file of its own, which transformers does not read.
MTP_FILE = "model-mtp.safetensors"

# System messages first, then the tools (when the request has any), then the turns; an assistant turn is
# closed by the eos token, and the generation prompt opens a new assistant turn. An assistant's tool calls
# (one "\n" between two, as V3's template writes) and the tool results that answer them use DeepSeek-V3's
# markup; `thinking` (a chat_template_kwargs key, as in DeepSeek-V3.1) opens the answer with <think> when
# true and closes thinking at once when false.
# Same shape as DeepSeek-V3's template, written anew.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{{- message['content'] -}}"
    "{%- endfor -%}"
    "{%- if tools -%}"
    "{{- '\\n\\n## Tools\\nCall a function by writing its name and JSON arguments.\\n' -}}"
    "{%- for tool in tools -%}"
    "{{- '\\n### ' + tool['function']['name'] + '\\n' + (tool['function']['description'] or '') + '\\n"
    "Parameters: ' + (tool['function']['parameters'] | tojson) + '\\n' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '" + USER + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + "' + (message['content'] or '') -}}"
    "{%- if message['tool_calls'] -%}"
    "{{- '" + CALLS_BEGIN + "' -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '" + CALL_BEGIN + "function" + SEP + "' + call['function']['name'] + '\\n```json\\n'"
    " + call['function']['arguments'] + '\\n```" + CALL_END + "' -}}"
    "{%- endfor -%}"
    "{{- '" + CALLS_END + "' -}}"
    "{%- endif -%}"
    "{{- '" + EOS + "' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '" + OUTPUTS_BEGIN + "' -}}{%- endif -%}"
    "{{- '" + OUTPUT_BEGIN + "' + message['content'] + '" + OUTPUT_END + "' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '" + OUTPUTS_END + "' -}}{%- endif -%}"
    "{%- elif message['role'] != 'system' -%}"
    "{{- raise_exception('the demo chat template supports the roles system, user, assistant and tool, not '"
    " + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '" + ASSISTANT + "' -}}"
    "{%- if thinking is defined -%}{{- '" + THINK + "' if thinking else '" + END_THINK + "' -}}{%- endif -%}"
    "{%- endif -%}"
)

CORPUS = [
    "A language model server spends most of its life waiting on memory. Every new token needs the "
    "keys and values of every earlier token, so the engine keeps them in a cache that lives on the "
    "accelerator. The cache is cut into small blocks of a fixed number of tokens, and a request owns "
    "a list of block numbers rather than one long stretch of memory. When a request finishes, its "
    "blocks go back to a free list, and the next request can take them at once.",
    "Scheduling is simple arithmetic. Each request knows how many of its tokens are already computed "
    "and how many exist in total. On every step the scheduler hands out a budget of tokens: a new "
    "prompt receives a large chunk, a running conversation receives one token, and a prompt that "
    "shares its opening words with an earlier one skips the blocks that are already cached. There is "
    "one rule for all of these cases, and that is why the scheduler stays small.",
    "Sampling turns the final logits into a choice. Greedy decoding takes the most likely token. "
    "Temperature flattens or sharpens the distribution, top-k keeps the k best candidates, and top-p "
    "keeps the smallest set whose probability reaches p. A seed makes a sampled answer repeatable, "
    "which matters when a user reports a strange reply and an engineer wants to see it again.",
    "Streaming lets a client read the answer while it is still being written. The detokenizer turns "
    "token ids back into text a few at a time. It must be careful: one character of Chinese text or "
    "one emoji can be split across two or three tokens, and a half character must never reach the "
    "screen. Stop strings add another wrinkle, because the first letters of a stop word could be "
    "sent before the engine knows whether the rest will follow.",
    "Batching is where throughput comes from. A single request leaves the accelerator idle while it "
    "reads weights from memory; a hundred requests share that read and finish in nearly the same "
    "time. The server therefore admits as many requests as the cache can hold, preempts the newest "
    "one when memory runs short, and recomputes its tokens later. Latency and throughput pull in "
    "different directions, and the operator chooses the balance with a few flags.",
    "Mixture of experts models route each token to a handful of expert networks out of many. Only "
    "the chosen experts run, so the model holds far more parameters than it uses for any one token. "
    "Latent attention compresses the keys and values into a small vector per token, which shrinks "
    "the cache and lets far longer conversations fit on the same hardware.",
    "服务大语言模型的时候，显存是最宝贵的资源。每生成一个新的词元，都需要读取之前所有词元的键和值。"
    "调度器把请求排好队，让加速器一直保持忙碌。流式输出让用户一边等待一边阅读回答。",
    "Tokens per second 🚀, time to first token ⏱️, and happy users 😊 are the numbers that matter. "
    "Café, naïve, and résumé keep their accents; 数字 and emoji keep their bytes.",
]


def train_bpe_tokenizer(corpus: list[str], vocab_size: int, special_tokens: list[str],
                        added_tokens: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `corpus`; special_tokens[0] is bos and special_tokens[1] is eos.

    All 256 byte tokens are in the vocabulary, so any text (any script, any emoji) encodes, and
    characters unseen in training are spelled with byte tokens that split a character across
    tokens — the case a detokenizer must handle. Encoding adds bos, like DeepSeek's tokenizers.
    added_tokens: appended after training as single, non-special tokens (ids from vocab_size on).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos = special_tokens[0], special_tokens[1]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in added_tokens or []])
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, clean_up_tokenization_spaces=False
    )


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def _write_tokenizer(path: str, tokenizer: PreTrainedTokenizerFast) -> None:
    # Written by hand rather than with save_pretrained so the files (and the chat template's place
    # in tokenizer_config.json) do not drift with the installed transformers version.
    tokenizer.backend_tokenizer.save(os.path.join(path, "tokenizer.json"))
    _write_json(
        os.path.join(path, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 2048,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def _save_quietly(model, path: str) -> None:
    # save_pretrained draws a progress bar; a CLI that writes the demo on first use should not.
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def write_demo_model(path: str) -> str:
    """Write the demo checkpoint (config, safetensors weights, tokenizer, generation config) to `path`."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    os.makedirs(path, exist_ok=True)
    tokenizer = train_bpe_tokenizer(CORPUS, VOCAB_SIZE, SPECIAL_TOKENS, MARKER_TOKENS)
    bos_id, eos_id = tokenizer.convert_tokens_to_ids([BOS, EOS])
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,  # must be explicit: the V3 default (128) would not match the heads
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    # fork_rng: the fixed seed must not leak into the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(config).to(torch.float32)
        mtp = _mtp_layer(model, DeepseekV3ForCausalLM)
    model.generation_config.bos_token_id = bos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    _save_quietly(model, path)
    from safetensors.torch import save_file

    save_file(mtp, os.path.join(path, MTP_FILE), metadata={"format": "pt"})
    _write_tokenizer(path, tokenizer)
    return path


def _mtp_layer(model, model_class) -> dict:
    """The MTP layer's tensors as DeepSeek-V3 ships them (model.layers.{num_hidden_layers}.*): a decoder
    layer (drawn as the last of a model one layer deeper), enorm, hnorm, eh_proj, shared_head.norm and
    the copies of the embedding and head. Draws from the caller's seeded generator."""
    import copy

    import torch

    n, hidden = model.config.num_hidden_layers, model.config.hidden_size
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n + 1
    deeper = model_class(config)
    prefix = f"model.layers.{n}."
    tensors = {k: v.contiguous() for k, v in deeper.state_dict().items() if k.startswith(prefix)}
    tensors.update({
        prefix + "eh_proj.weight": 0.02 * torch.randn(hidden, 2 * hidden),
        prefix + "enorm.weight": torch.ones(hidden),
        prefix + "hnorm.weight": torch.ones(hidden),
        prefix + "shared_head.norm.weight": torch.ones(hidden),
        prefix + "shared_head.head.weight": model.lm_head.weight.detach().clone(),
        prefix + "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
    })
    return tensors


def default_demo_path() -> str:
    cache = envs.XDG_CACHE_HOME or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "deepserve", CACHE_NAME)


def _is_complete(path: str) -> bool:
    names = ("config.json", "model.safetensors", MTP_FILE, "tokenizer.json", "tokenizer_config.json")
    return all(os.path.isfile(os.path.join(path, n)) for n in names)


def ensure_demo_model(path: str | None = None) -> str:
    """Return a folder holding the demo model, writing it on first use.

    The model is written to a temporary sibling folder and renamed into place, so a reader never
    sees a half-written folder and two processes racing both end up with the same complete one.
    """
    path = os.path.abspath(path or default_demo_path())
    if _is_complete(path):
        return path
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        write_demo_model(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp made it private; the cache is readable like any download
        try:
            # Atomic on POSIX; fails when another process already put a non-empty folder there.
            os.rename(tmp, path)
        except OSError:
            if not _is_complete(path):
                raise RuntimeError(
                    f"{path} exists but does not hold a complete demo model; delete it and run again"
                ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
