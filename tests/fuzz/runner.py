"""Runs one fuzz target of ``targets.py`` under atheris (libFuzzer), in this process.

    python -m tests.fuzz.runner TARGET [--seed-corpus DIR] [libFuzzer flags and corpus dirs...]
    python -m tests.fuzz.runner TARGET --repro FILE...     (run saved inputs, no fuzzing)

``--seed-corpus DIR`` writes the target's seeds (valid messages) into DIR and fuzzes
from there. Run from the repository root (``tests`` is imported as a package), inside a
private network namespace for the transport target. A crash makes libFuzzer save the input
(``-artifact_prefix``) and exit non-zero; a Python exception is printed with its traceback.
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback


def _write_seeds(name: str, directory: str) -> None:
    from tests.fuzz import targets

    os.makedirs(directory, exist_ok=True)
    for s in targets.seeds(name):
        with open(os.path.join(directory, "seed-" + hashlib.sha1(s).hexdigest()[:16]), "wb") as f:
            f.write(s)


def _repro(name: str, paths: list[str]) -> int:
    from tests.fuzz import targets

    failed = 0
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        try:
            targets.run_one(name, data)
            if name == "transport":
                targets._rig.check()
            print(f"{p}: ok")
        except Exception:  # noqa: BLE001 - report every failure
            failed += 1
            print(f"{p}: {data!r}")
            traceback.print_exc()
    return 1 if failed else 0


def _instrument(atheris, prefixes: tuple[str, ...]) -> int:
    """Instrument every function and method defined in the modules under ``prefixes``."""
    import inspect

    done: set[int] = set()

    def one(fn) -> None:
        fn = inspect.unwrap(fn) if callable(fn) else fn
        if inspect.isfunction(fn) and id(fn) not in done and fn.__module__ and fn.__module__.startswith(prefixes):
            done.add(id(fn))
            try:
                atheris.instrument_func(fn)
            except Exception:  # noqa: BLE001 - a function atheris cannot rewrite stays as it is
                pass

    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(prefixes):
            continue
        for obj in list(vars(mod).values()):
            if inspect.isclass(obj) and obj.__module__ == name:
                for attr in vars(obj).values():
                    if isinstance(attr, (staticmethod, classmethod)):
                        attr = attr.__func__
                    elif isinstance(attr, property):
                        for f in (attr.fget, attr.fset):
                            if f is not None:
                                one(f)
                        continue
                    one(attr)
            else:
                one(obj)
    return len(done)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    name, rest = argv[1], argv[2:]
    if "--repro" in rest:
        return _repro(name, [a for a in rest if a != "--repro"])
    # UCX warns of every message with an id no engine handles: the transport target sends some.
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    import atheris

    # Coverage of this project's Python code guides the fuzzer. The editable install loads
    # mooncake_ray through a custom loader, which instrument_imports() misses, and
    # instrument_all() takes a minute (it rewrites Ray too): import first, then instrument
    # the functions of this project's modules. The native module is not instrumented: its
    # targets are driven by mutating the seeds alone.
    from tests.fuzz import targets
    import mooncake_ray._private.master.actor  # noqa: F401 - the handler table's methods
    import mooncake_ray._private.store.actor  # noqa: F401 - _promote_item_ok

    _instrument(atheris, ("mooncake_ray", "tests.fuzz"))

    if "--seed-corpus" in rest:  # after the imports: modules imported before are not instrumented
        i = rest.index("--seed-corpus")
        directory = rest[i + 1]
        del rest[i:i + 2]
        _write_seeds(name, directory)
        rest.append(directory)

    fn = targets.TARGETS[name][0]
    runs = next((int(a.split("=", 1)[1]) for a in rest if a.startswith("-runs=")), 0)
    calls = 0

    def one(data: bytes) -> None:
        nonlocal calls
        calls += 1
        fn(data)
        if name == "transport" and runs and calls >= runs:
            targets.transport_finish()  # libFuzzer exits after this input: check once more

    atheris.Setup([argv[0], *rest], one)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
