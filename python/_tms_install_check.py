"""Whether tms-memory-saver's copies of torch_memory_saver's files are still ours.

The wheel owns files under torch_memory_saver's names (the ``torch_memory_saver`` package and the
``torch_memory_saver_hook_mode_*.abi3.so`` libraries). pip knows it as tms-memory-saver, so a
framework whose install pins ``torch_memory_saver==0.0.10`` (SGLang, slime, verl) installs
upstream's files over ours, and ``pip uninstall torch_memory_saver`` deletes them, while pip still
lists tms-memory-saver. This module compares those files with the sizes our RECORD gives:

- ``tms_memory_saver.pth`` calls ``at_startup()`` when the interpreter starts: it reads RECORD and
  stats the files (well under a millisecond), prints nothing for a healthy install, never
  raises, and otherwise writes one warning to stderr naming the files and the repair command;
- ``import tms`` calls ``refuse_import()``, which raises ImportError with the same text.

Installs without our RECORD beside this file (scripts/install.sh, a checkout, another package
manager) are not checked. Nothing here imports more than os and sys on the healthy path.
"""

import os
import sys

# The distribution's version (pyproject.toml; setup.py refuses to build a wheel where they differ).
VERSION = "0.1.0"
DIST_INFO = "tms_memory_saver-%s.dist-info" % VERSION
# Paths of ours that torch_memory_saver's distribution also owns.
SHARED = ("torch_memory_saver/", "torch_memory_saver_hook_mode_")


def problems(site=None):
    """(replaced, missing) paths of our RECORD under torch_memory_saver's names in ``site``
    (default: the folder holding this module), or None when no RECORD of ours is there."""
    site = site or os.path.dirname(os.path.abspath(__file__))
    try:
        with open(os.path.join(site, DIST_INFO, "RECORD"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    replaced, missing = [], []
    for line in lines:
        # path,hash,size: our paths have no comma, so csv quoting never applies.
        path, _, rest = line.partition(",")
        size = rest.rpartition(",")[2]
        if not path.startswith(SHARED) or not size.isdigit():
            continue  # other files, and compiled bytecode (no size)
        try:
            st = os.stat(os.path.join(site, path))
        except OSError:
            missing.append(path)
            continue
        if st.st_size != int(size):
            replaced.append(path)
    return replaced, missing


def _installed_from(site):
    """What pip installed the wheel from (PEP 610's direct_url.json), for the repair command."""
    try:
        import json
        from urllib.parse import unquote, urlsplit

        with open(os.path.join(site, DIST_INFO, "direct_url.json"), encoding="utf-8") as f:
            url = json.load(f)["url"]
        parts = urlsplit(url)
        return unquote(parts.path) if parts.scheme == "file" else url
    except Exception:
        return "tms-memory-saver==%s" % VERSION


def _upstream_requirement(site):
    """torch_memory_saver at the version pip records in ``site``, if it records one."""
    try:
        for name in os.listdir(site):
            if name.startswith("torch_memory_saver-") and name.endswith(".dist-info"):
                return "torch_memory_saver==" + name[len("torch_memory_saver-") : -len(".dist-info")]
    except OSError:
        pass
    return "torch_memory_saver"


def _quote(word):
    import shlex

    return shlex.quote(word)


def message(site, replaced, missing):
    """The warning: what happened to which files, and the commands that repair it."""
    python = _quote(sys.executable or "python")
    # The libraries first: LD_PRELOAD names them.
    names = sorted(replaced + missing, key=lambda path: (not path.endswith(".so"), path))
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    if replaced:
        what = "%d of them replaced by another package's" % len(replaced)
        if missing:
            what += ", %d missing" % len(missing)
        effect = (
            "`import torch_memory_saver` and LD_PRELOAD's torch_memory_saver_hook_mode_*.abi3.so now load "
            "another torch_memory_saver (upstream's), not tms, and `import tms` fails. A package that pins "
            "torch_memory_saver (SGLang, slime, verl) was probably installed after tms-memory-saver"
        )
    else:
        what = "%d of them missing" % len(missing)
        effect = (
            "`import torch_memory_saver`, LD_PRELOAD's torch_memory_saver_hook_mode_*.abi3.so and `import tms` "
            "fail. `pip uninstall torch_memory_saver` probably removed them (pip lists both distributions as "
            "owning these files)"
        )
    return (
        "tms-memory-saver: torch_memory_saver's files in %s are no longer tms's (%s: %s). %s.\n"
        "  put tms back:                    %s -m pip install --force-reinstall --no-deps %s\n"
        "  or use torch_memory_saver's own: %s -m pip uninstall -y tms-memory-saver && "
        "%s -m pip install --force-reinstall %s\n"
        % (site, what, shown, effect, python, _quote(_installed_from(site)), python, python,
           _upstream_requirement(site))
    )


_checked = False


def at_startup():
    """The interpreter start-up check (tms_memory_saver.pth): one warning on stderr when our
    files were replaced or removed; silent otherwise; never raises. Once per process (a venv's
    lib64 link to lib makes site read the .pth twice)."""
    global _checked
    if _checked:
        return
    _checked = True
    try:
        found = problems()
        if found and (found[0] or found[1]):
            site = os.path.dirname(os.path.abspath(__file__))
            sys.stderr.write(message(site, *found))
            sys.stderr.flush()
    except Exception:
        pass


def refuse_import(package_dir):
    """Raises ImportError with the warning's text when the wheel that installed the package in
    ``package_dir`` (tms) had its torch_memory_saver files replaced or removed."""
    site = os.path.dirname(os.path.abspath(package_dir))
    try:
        found = problems(site)
    except Exception:
        return
    if found and (found[0] or found[1]):
        raise ImportError(message(site, *found).rstrip("\n"))
