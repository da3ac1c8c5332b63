"""`python -m shardc ...`: command-line tools.

    python -m shardc rules          the primitives with a factor rule
    python -m shardc version
    python -m shardc verify-rules   prove every PCG substitution rule with Z3 (or refute it);
                                    --record writes the proof record the rewrite engine trusts
    python -m shardc generate-rules enumerate, fingerprint, verify and save generated PCG rules
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


def _verify_rules(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from shardc.pcg.lang import RuleSyntaxError, parse_rules
    from shardc.pcg.library import all_rules, library_rules
    from shardc.pcg.verify import verify_rule

    if args.files:
        rules = []
        for f in args.files:
            try:
                rules += parse_rules(Path(f).read_text())
            except RuleSyntaxError as e:
                print(f"{f}: {e}")
                return 2
            except OSError as e:
                print(f"{f}: cannot read the rules file ({e.strerror or e})")
                return 2
    else:
        rules = library_rules() if args.library_only else all_rules()
    if args.record and (args.files or args.library_only):
        print("--record writes the packaged record of the library and generated rules: give no FILES and no "
              "--library-only")
        return 2
    t0 = time.perf_counter()
    failed = 0
    proved = []
    for r in rules:
        v = verify_rule(r, use_record=False)  # this command is what the proof record trusts: always Z3
        if v.proved:
            proved.append((r.name, r.text))
            print(f"{r.name}: proved ({v.instances} instances)")
        else:
            failed += 1
            print(f"{r.name}: REFUTED  {r.text}")
            print(f"    counterexample: {v.counterexample}")
    dt = time.perf_counter() - t0
    print(f"{len(rules) - failed} of {len(rules)} rules proved, {failed} refuted ({dt:.1f} s)")
    if args.record:
        from shardc.pcg.proofs import write_record

        print(f"wrote {write_record(proved)} ({len(proved)} proved rules; refuted ones are not recorded)")
    return 1 if failed else 0


def _generate_rules(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shardc.pcg.generate import format_rules_file, generate_rules
    from shardc.pcg.library import GENERATED_FILE, data_path

    report = generate_rules(max_ops=args.max_ops, progress=print)
    print(f"enumerated: {report.enumerated} terms ({report.well_typed} well-typed)")
    print(f"candidates: {report.candidates} (equal fingerprints), redundant: {report.redundant}")
    print(f"verified:   {report.verified} proved by Z3, {report.refuted} refuted")
    print(f"kept:       {len(report.kept)} ({report.seconds:.1f} s)")
    out = Path(args.out) if args.out else data_path(GENERATED_FILE)
    out.write_text(format_rules_file(report, args.max_ops))
    print(f"wrote {out}")
    if not args.out:
        print("the proof record does not list the new rules yet: run `python -m shardc verify-rules --record`")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardc", description="A GShard-style SPMD sharding compiler for JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("rules", help="list the primitives with a factor rule").set_defaults(run=_rules)
    sub.add_parser("version", help="print versions").set_defaults(run=_version)
    vr = sub.add_parser("verify-rules", help="prove PCG substitution rules with Z3; non-zero exit if any fails")
    vr.add_argument("files", nargs="*", help="rule files to check (default: the library and the generated rules)")
    vr.add_argument("--library-only", action="store_true", help="skip the generated rules")
    vr.add_argument("--record", action="store_true",
                    help="write the proof record (shardc/pcg/data/proofs.record) the rewrite engine trusts "
                         "instead of running Z3 in every process")
    vr.set_defaults(run=_verify_rules)
    gr = sub.add_parser("generate-rules", help="generate, verify and save PCG rules (TASO-style)")
    gr.add_argument("--max-ops", type=int, default=3, help="ops per pattern (default 3)")
    gr.add_argument("--out", help="where to write (default: shardc/pcg/data/generated.rules)")
    gr.set_defaults(run=_generate_rules)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
