"""The ``pagedserve`` command: generate (offline), serve (Ray Serve), kv-size."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve.cluster.cli.args import add_engine_args, engine_config_from_args, resolve_model_or_exit


def _add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="complete one prompt offline and print it")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve.cluster.llm import LLM
    from pagedserve.scheduler.sampling_params import SamplingParams

    cfg = resolve_model_or_exit(engine_config_from_args(args))
    llm = LLM(**vars(cfg))
    prompt = args.prompt
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.max_tokens, stop=args.stop,
                            ignore_eos=args.ignore_eos, seed=args.seed)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    for c in out.outputs:
        prefix = f"[{c.index}] " if len(out.outputs) > 1 else ""
        print(f"{prefix}{c.text}")
        print(f"{prefix}(finish_reason={c.finish_reason}, tokens={len(c.token_ids)})", file=sys.stderr)
    llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    try:
        from pagedserve.cluster.cli.serve import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    from pagedserve.cluster.cli.kv_size import add_kv_size_parser

    add_kv_size_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
