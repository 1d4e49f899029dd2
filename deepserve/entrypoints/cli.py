"""`deepserve` command line: generate, chat, demo-model, serve, keys, router, bench, plan."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from deepserve.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags, with vLLM's names, shared by every command that builds an engine. Their dests are
    recorded on the parser (`_engine_dests`): engine_args_from reads those and no other flag."""
    d = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer folder (default: the model's)")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' and activations' dtype (auto: the checkpoint's 16-bit type on a GPU, float32 on CPU)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the dummy weights and of torch's global generator")
    # vLLM's flag, in DeepSeek's own vLLM commands; EngineArgs logs once that it changes nothing.
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility and has no effect: deepserve never runs a checkpoint's "
                        "remote code (its models are its own implementations)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of the GPU's memory the engine may use (weights, activations, KV cache)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV-cache blocks to allocate instead of what memory profiling finds (tests)")
    g.add_argument("--cpu-kv-cache-gib", type=float, default=d.cpu_kv_cache_gib,
                   help="KV cache size when running on CPU (GiB)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one step (default: 8192 with chunked prefill, else max_model_len)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps so decodes keep running beside them")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes seen before")
    g.add_argument("--swap-space", type=float, default=d.swap_space,
                   help="GiB of host memory (pinned on CUDA) for the KV blocks of preempted requests, copied "
                        "back when they resume instead of recomputed, and for prefix-cache blocks evicted from "
                        "the GPU, found again by prefix hits; 0: no host tier")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   help="auto: the model's dtype; fp8 (= fp8_e4m3): float8_e4m3fn with per-layer k/v scales "
                        "(the checkpoint's, else 1.0), twice the tokens per GiB")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs each layer is split over")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages (consecutive layers per stage)")
    g.add_argument("--nnodes", type=int, default=d.nnodes,
                   help="nodes the engine spans (tensor_parallel_size x pipeline_parallel_size / nnodes ranks on each)")
    g.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="this node's index; 0 runs the engine (and the server), k > 0 only serves its ranks")
    g.add_argument("--master-addr", default=d.master_addr, help="node 0's address, reachable from every node")
    g.add_argument("--master-port", type=int, default=d.master_port,
                   help="the torch.distributed rendezvous port on node 0 (needed with --nnodes > 1)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="the tensor-parallel ranks split the MoE routed experts (whole experts per rank) "
                        "instead of each expert's intermediate size")
    g.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                   help="auto: the checkpoint's safetensors; dummy: random weights in the model's shapes")
    g.add_argument("--decryption-key-file", default=d.decryption_key_file, metavar="PATH",
                   help="key of a checkpoint encrypted with deepserve encrypt-model (64 hex characters); its "
                        "weights are decrypted in memory while loading")
    g.add_argument("--quantization", "-q", default=None, choices=["fp8", "awq", "gptq", "none"],
                   help="weight quantization (default: the checkpoint's; DeepSeek-V3/R1's FP8 is served as shipped, "
                        "AWQ / GPTQ int4 checkpoints as int4): fp8 also quantizes an unquantized checkpoint at load "
                        "(per-channel weights, per-token activations); awq / gptq must match the checkpoint's "
                        "quant_method (with --load-format dummy: random int4 weights for any model); none "
                        "dequantizes a quantized checkpoint to --dtype")
    g.add_argument("--device", default=d.device, choices=["auto", "cuda", "cpu"],
                   help="auto: CUDA when a GPU is present, else CPU")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run without decode CUDA graphs (default: graphs on one GPU, eager under tensor "
                        "parallelism; --no-enforce-eager captures them on tensor-parallel ranks too, "
                        "experimental); pipeline stages always run eager")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step before the previous step's tokens are read, so "
                        "host work overlaps the GPU (default: on for one CUDA GPU; opt-in under tensor "
                        "parallelism; not with pipeline parallelism)")
    g.add_argument("--hf-overrides", type=_json_object, default={}, metavar="JSON",
                   help='config.json fields to replace, e.g. \'{"num_hidden_layers": 8}\' (a slice of a model)')
    g.add_argument("--speculative-config", type=_json_object_flag("--speculative-config"), default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 1, "prompt_lookup_max": 3}\' (n-gram prompt lookup, any model) or '
                        '\'{"method": "mtp", "num_speculative_tokens": 1}\' (DeepSeek-V3/R1 checkpoints with their '
                        'MTP layer; "deepseek_mtp" too)')
    parser.set_defaults(_engine_dests=tuple(action.dest for action in g._group_actions))


def _json_object_flag(flag: str):
    """The argparse type of a JSON-object flag; its errors name the flag."""

    def parse(text: str | dict) -> dict:
        if isinstance(text, dict):  # from a --config YAML file, already parsed
            return text
        if not isinstance(text, str):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {type(text).__name__}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {type(value).__name__}")
        return value

    return parse


_json_object = _json_object_flag("--hf-overrides")


def engine_args_from(ns: argparse.Namespace, model: str | None) -> EngineArgs:
    """The EngineArgs of the flags. On a node other than 0 (--node-rank k) there is no engine to
    build: this runs the node's tensor-parallel ranks until node 0 stops, then exits the command."""
    args = _engine_args(ns, model)
    if args.node_rank != 0:
        raise SystemExit(_run_worker_node(args))
    return args


def _run_worker_node(args: EngineArgs) -> int:
    from deepserve.runner.worker import leave_now, run_node

    config = args.create_engine_config()  # the same checks node 0 makes, before joining
    backend = "nccl" if config.model.device == "cuda" else "gloo"
    leave_now(run_node(config.parallel, backend))  # never returns: no teardown of the process group


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in --help, except where the help text already says what the default is
    ("(default: the model's)"), or the default is None (unset: the help says what happens then). argparse
    shows nothing for a flag without help, so every flag with a default needs a help text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        # "(default", not "default": a help text may use the word for something else ("the default when
        # a request has tools").
        if action.default is None or "(default" in text.lower():
            return text
        return super()._get_help_string(action)


def _engine_args(ns: argparse.Namespace, model: str | None) -> EngineArgs:
    """Every flag of add_engine_args (each dest is its EngineArgs field's name), and the model. Read by name,
    so a new engine flag cannot be parsed and then dropped (--decryption-key-file once was); read from
    add_engine_args' own dests only, so a command's same-named flag with another meaning (bench serve's
    --seed, plan's --max-model-len) never reaches the engine."""
    dests = getattr(ns, "_engine_dests", None)
    if dests is None:
        raise TypeError("engine_args_from needs a parser built with add_engine_args")
    return EngineArgs(**({dest: getattr(ns, dest) for dest in dests} | {"model": model}))


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per output")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    parser.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: all)")
    parser.add_argument("--n", type=int, default=1, help="outputs per prompt")
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="seed of the sampling (default: torch's global generator, which --seed seeds)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per output")


def _sampling_params(ns: argparse.Namespace):
    from deepserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, n=ns.n, seed=ns.sampling_seed)


def _print_outputs(outputs, as_json: bool) -> None:
    for out in outputs:
        for c in out.outputs:
            if as_json:
                print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text,
                                  "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
            else:
                print(f"--- {out.prompt!r} [{c.index}] ({c.finish_reason}, {len(c.token_ids)} tokens)")
                print(c.text)


def preset_tokenizer(ns: argparse.Namespace) -> None:
    """A shape preset with dummy weights has no tokenizer; give it one that covers its vocabulary
    (loader/vocab_tokenizer.py) unless --tokenizer names one, so text prompts work (serve, generate, chat)."""
    from deepserve.loader.presets import is_preset, resolve_hf_config

    if ns.model and ns.load_format == "dummy" and not ns.tokenizer and is_preset(ns.model):
        from deepserve.loader.vocab_tokenizer import vocab_tokenizer_dir

        ns.tokenizer = vocab_tokenizer_dir(ns.model, resolve_hf_config(ns.model, ns.hf_overrides, "dummy"))
        logging.getLogger(__name__).warning("preset %s with dummy weights: using the vocabulary-covering "
                                            "tokenizer in %s (random text; token-id prompts work as usual)",
                                            ns.model, ns.tokenizer)


class _ModelArg(argparse.Action):
    """MODEL given positionally or as --model MODEL, into one dest. Two different models are refused: which
    one would win depends on argparse's order of work, not on anything the user can see."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:  # the positional, absent: argparse calls its action with the default
            return
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None and os.path.normpath(earlier) != os.path.normpath(values):
            parser.error(f"two models given, {earlier} and {values}: give one, as MODEL or as --model MODEL")
        setattr(namespace, self.dest, values)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model of serve and run-batch: first positional, as they always took it, or --model as generate,
    chat and bench take it (vLLM's `vllm serve` takes both), so either habit works on every command."""
    parser.add_argument("model", nargs="?", default=None, action=_ModelArg,
                        help="checkpoint folder or preset name (default: the built-in demo model)")
    parser.add_argument("--model", dest="model", default=None, action=_ModelArg, metavar="MODEL",
                        help="the same as the positional MODEL")


def refuse_model_as_prompt(ns: argparse.Namespace, prompt: str) -> None:
    """Without --model, a first prompt that names a checkpoint folder or a preset is the model given the way
    serve and run-batch take it (`generate ./demo "Hello"`): refused, since it would be sent as a prompt to the
    built-in demo model and the run would look like it worked."""
    from deepserve.loader.presets import is_preset

    if ns.model is None and (os.path.isdir(prompt) or is_preset(prompt)):
        raise ValueError(f"{prompt!r} names a model, not a prompt: {ns.command} takes the model as a flag; pass "
                         f"the model with --model {prompt}")


def cmd_generate(ns: argparse.Namespace) -> int:
    from deepserve.entrypoints.llm import LLM

    refuse_model_as_prompt(ns, ns.prompts[0])
    preset_tokenizer(ns)
    llm = LLM(**vars(engine_args_from(ns, ns.model)))
    _print_outputs(llm.generate(ns.prompts, _sampling_params(ns), use_tqdm=False), ns.json)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from deepserve.entrypoints.llm import LLM

    refuse_model_as_prompt(ns, ns.message)
    preset_tokenizer(ns)
    llm = LLM(**vars(engine_args_from(ns, ns.model)))
    messages = [{"role": "user", "content": ns.message}]
    _print_outputs(llm.chat(messages, _sampling_params(ns), use_tqdm=False), ns.json)
    return 0


def cmd_demo_model(ns: argparse.Namespace) -> int:
    from deepserve.demo import write_demo_model

    print(write_demo_model(ns.path))
    return 0


def cmd_encrypt_model(ns: argparse.Namespace) -> int:
    from deepserve.loader.encryption import encrypt_model, new_key_file, read_key_file

    if ns.new_key_file:
        try:
            new_key_file(ns.key_file)
        except FileExistsError:
            raise ValueError(f"--new-key-file: {ns.key_file} exists; pick another path or drop --new-key-file "
                             "to use that key") from None
    written = encrypt_model(ns.src, ns.dst, read_key_file(ns.key_file, "--key-file"), ns.cipher)
    print(f"wrote {len(written)} files to {ns.dst} ({ns.cipher}); serve it with --decryption-key-file {ns.key_file}")
    return 0


LOG_LEVEL_HELP = ("DEBUG, INFO, WARNING or ERROR (default: INFO for serve and router, which report their start-up "
                  "and address; WARNING otherwise)")


def _log_level_here_too(sub: argparse._SubParsersAction) -> None:
    """--log-level after the command as well (`deepserve serve --log-level DEBUG`); SUPPRESS keeps the one given
    before it (`deepserve --log-level DEBUG serve`) when this one is not."""
    for p in sub.choices.values():
        p.add_argument("--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepserve", description="Serve DeepSeek models.")
    parser.add_argument("--log-level", default=None, help=LOG_LEVEL_HELP)
    from deepserve import __version__

    parser.add_argument("--version", action="version", version=f"deepserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts, offline",
                         formatter_class=DefaultsHelp)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default=None, help="checkpoint folder (default: the built-in demo model)")
    _add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="one chat turn through the checkpoint's chat template",
                          formatter_class=DefaultsHelp)
    chat.add_argument("message")
    chat.add_argument("--model", default=None)
    _add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    demo = sub.add_parser("demo-model", help="write the built-in tiny demo checkpoint to PATH")
    demo.add_argument("path")
    demo.set_defaults(func=cmd_demo_model)

    enc = sub.add_parser("encrypt-model", help="encrypt a checkpoint's weights at rest (SRC stays as it is)",
                         description="Seal every shard of SRC (those its model.safetensors.index.json lists, "
                                     "subfolders kept, and its top-level *.safetensors) into DST as *.safetensors.enc "
                                     "(authenticated encryption, random access by 1 MiB chunk); config and "
                                     "tokenizer files are copied as they are. Serve DST with "
                                     "--decryption-key-file KEY.")
    enc.add_argument("src", help="checkpoint folder")
    enc.add_argument("dst", help="folder for the encrypted checkpoint (created)")
    enc.add_argument("--key-file", required=True, metavar="PATH",
                     help="key file: 32 bytes as 64 hex characters (see --new-key-file)")
    enc.add_argument("--new-key-file", action="store_true",
                     help="write a fresh random key to --key-file first (refused if the file exists)")
    enc.add_argument("--cipher", default="aes-256-gcm", choices=["aes-256-gcm", "sm4-gcm"],
                     help="AEAD cipher (default: aes-256-gcm; sm4-gcm for deployments held to SM4)")
    enc.set_defaults(func=cmd_encrypt_model)

    _add_server_commands(sub)
    from deepserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from deepserve.planner.cli import add_plan_parser

    add_plan_parser(sub)
    _log_level_here_too(sub)
    return parser


def _add_server_commands(sub: argparse._SubParsersAction) -> None:
    try:
        from deepserve.entrypoints.serve import add_audit_parser, add_keys_parser, add_serve_parser
    except ImportError:  # the server extras are part of the package; this guards partial installs
        return
    add_serve_parser(sub)
    from deepserve.entrypoints.batch import add_batch_parser

    add_batch_parser(sub)
    add_keys_parser(sub)
    add_audit_parser(sub)
    from deepserve.router.cli import add_router_parser

    add_router_parser(sub)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    ns._argv = argv  # `serve --config` tells the flags given from those left at their defaults
    level = ns.log_level or ("INFO" if ns.command in ("serve", "router") else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns) or 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"deepserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
