"""A costly module fixture computed once per test run, also when pytest-xdist spreads the module's tests
over several workers (``make test`` runs ``-n``): the first worker computes it, the others wait for it
and read it back (a JSON file in the run's base temporary directory, under a lock)."""

import json

from filelock import FileLock


def run_once(request, tmp_path_factory, name: str, compute):
    """``compute()`` (JSON-serializable), once per run for ``name``."""
    if not hasattr(request.config, "workerinput"):   # one process runs every test
        return compute()
    path = tmp_path_factory.getbasetemp().parent / f"{name}.json"   # the run's, shared by its workers
    with FileLock(f"{path}.lock"):
        if not path.exists():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())
