"""``python -m tms library [--mode preload|torch]``: print the path of the installed hook (for
LD_PRELOAD); ``python -m tms version``: the hook's version (exit 0, or 2 when none is found);
``python -m tms doctor [--json]``: check the installation as a whole and say what to fix (exit 0
all good, 1 a problem)."""

import argparse
import sys

from ._lib import load, packaged_hook, preloaded_hook


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tms", description=__doc__.split("\\n\\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lib = sub.add_parser("library", help="print the hook's path (for LD_PRELOAD)")
    lib.add_argument("--mode", choices=("preload", "torch"), default="preload")
    sub.add_parser("version", help="print the hook's version")
    sub.add_parser("doctor", help="check the installation as a whole (python -m tms doctor --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        from .doctor import main as doctor

        return doctor(argv[1:])
    args = parser.parse_args(argv)
    path = packaged_hook(getattr(args, "mode", "preload")) or preloaded_hook()
    if path is None:
        print("python -m tms: no libtms_hook.so installed; install the tms-memory-saver wheel or set TMS_LIBRARY", file=sys.stderr)
        return 2
    if args.command == "library":
        print(path)
    else:
        print(load(path).tms_version().decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
