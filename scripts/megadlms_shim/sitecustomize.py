"""Run by Python at start-up when this folder is first on PYTHONPATH (scripts/megadlms_baseline.py puts it
there for MegaDLMs' processes only): installs the import hooks of :mod:`megadlms_te_compat` (TE 1.x names) and
:mod:`megadlms_args_compat` (``--moe-router-type``), then runs the interpreter's own ``sitecustomize`` if there is one
further down the path (this file shadows it)."""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
for _name, _what in (("megadlms_te_compat", "TE compatibility"), ("megadlms_args_compat", "--moe-router-type")):
    try:
        __import__(_name).install()
    except Exception as e:  # noqa: BLE001 - never break the interpreter; MegaDLMs then fails with its own message
        print(f"megadlms_shim: {_what} hook not installed: {type(e).__name__}: {e}", file=sys.stderr)

for _entry in sys.path:
    _path = os.path.join(os.path.abspath(_entry or os.getcwd()), "sitecustomize.py")
    if os.path.dirname(_path) != _here and os.path.isfile(_path):
        with open(_path) as _f:
            exec(compile(_f.read(), _path, "exec"), {"__name__": "sitecustomize", "__file__": _path})
        break
