"""`python -m shardc ...`: command-line tools.

    python -m shardc rules          the primitives with a factor rule
    python -m shardc version
"""
from __future__ import annotations

import argparse
import sys


def _rules(_: argparse.Namespace) -> int:
    from shardc.rules import registered_primitives

    names = registered_primitives()
    print(f"{len(names)} primitives have factor rules:")
    for n in names:
        print(f"  {n}")
    return 0


def _version(_: argparse.Namespace) -> int:
    import jax

    import shardc

    print(f"shardc {shardc.__version__} (jax {jax.__version__})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardc", description="A GShard-style SPMD sharding compiler for JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("rules", help="list the primitives with a factor rule").set_defaults(run=_rules)
    sub.add_parser("version", help="print versions").set_defaults(run=_version)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
