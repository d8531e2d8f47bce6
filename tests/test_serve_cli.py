"""``pagedserve serve``'s arguments as vLLM users write them. The CLI as a user runs it
(its own Ray, placement, answers, a clean exit) is tested on the default model, in
tests/test_gguf_model.py (one server start for both)."""

from __future__ import annotations


def test_cli_names_the_model_as_vllm_does(serve_model):
    """--served-model-name wins for the id; root (and the default id) is --model as given,
    a built-in name included. No Ray: only the argument parsing and resolution the serve
    command runs first."""
    from pagedserve.cluster.cli.args import engine_config_from_args, resolve_model_or_exit
    from pagedserve.cluster.cli.main import build_parser

    def cfg(*argv):
        args = build_parser().parse_args(["serve", *argv])
        return resolve_model_or_exit(engine_config_from_args(args))

    plain = cfg("--model", serve_model)
    assert (plain.served_model_name, plain.model_root) == (serve_model, serve_model)
    named = cfg("--model", serve_model, "--served-model-name", "my-llama", "--max-logprobs", "-1")
    assert (named.served_model_name, named.model_root, named.max_logprobs) == ("my-llama", serve_model, -1)
    demo = cfg("--model", "pagedserve-demo")
    assert (demo.served_model_name, demo.model_root) == ("pagedserve-demo", "pagedserve-demo")
    assert demo.model != "pagedserve-demo"  # the engine loads the resolved directory
    assert build_parser().parse_args(["generate", "--prompt", "x", "--max-logprobs", "5"]).max_logprobs == 5
