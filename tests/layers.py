"""The suite's layers, which follow the package's: every test is marked with exactly one, by its module's
`pytestmark` or on the test itself (the closest mark wins), and a test that is not is a collection error.

- unit: no engine and no server process (pure functions, the ledger, parsers, the scheduler over a fake runner);
  `make test-fast` runs this layer alone for the edit-test loop.
- engine: an in-process engine (`kiln.Engine`, `build_engine`), or transformers' reference model, on a tiny or
  the default model.
- server: real `kiln serve` processes over HTTP.
- slow: several ranks or replicas, fault injection, GPU compiles: the longest, still run by `make test`.

The layers are checked while the tests run, not trusted: a unit test that builds an engine or starts a server, or
an engine test that starts a server, fails naming the mark it needs."""

from __future__ import annotations

import subprocess

import pytest

LAYERS = ("unit", "engine", "server", "slow")
_RANK = {layer: i for i, layer in enumerate(LAYERS)}


def configure(config: pytest.Config) -> None:
    for layer, what in (
        ("unit", "no engine and no server process: seconds"),
        ("engine", "an in-process engine"),
        ("server", "real `kiln serve` processes over HTTP"),
        ("slow", "several ranks or replicas, fault injection, GPU compiles"),
    ):
        config.addinivalue_line("markers", f"{layer}: {what} (tests/layers.py)")


def layer_of(item: pytest.Item) -> str | None:
    """The closest of the layer marks on the test (its own, its class's, then its module's)."""
    for mark in item.iter_markers():
        if mark.name in _RANK:
            return mark.name
    return None


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(
        "--layer",
        action="append",
        choices=LAYERS,
        help="run only the tests of this layer (repeatable); a test's layer is its closest mark, where `-m` would "
        "also take a unit test of a server module for a server test",
    )


def select_collected(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuses unmarked tests; with --layer, keeps only the tests of those layers."""
    unmarked = [item.nodeid for item in items if layer_of(item) is None]
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} tests have no layer mark ({', '.join(LAYERS)}; see tests/layers.py), e.g. "
            + ", ".join(unmarked[:5])
        )
    wanted = config.getoption("--layer")
    if wanted:
        kept = [item for item in items if layer_of(item) in wanted]
        config.hook.pytest_deselected(items=[item for item in items if layer_of(item) not in wanted])
        items[:] = kept
    heaviest_files_first(items)


def heaviest_files_first(items: list[pytest.Item]) -> None:
    """Files in the order of their heaviest layer, slow first, unit last, each file's tests kept together and in
    order: `make test`'s workers take one file at a time in this order (xdist's loadfile), so the longest files
    start early and the seconds-long unit files fill the end, rather than one worker running a multi-rank file
    alone while the other has finished."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    weight = {name: max(_RANK[layer_of(i) or "unit"] for i in group) for name, group in files.items()}
    items[:] = [i for name in sorted(files, key=lambda n: -weight[n]) for i in files[name]]


def _starts_a_server(args) -> bool:
    words = [str(a) for a in (args if isinstance(args, list | tuple) else [args])]
    return (
        "kiln.cli" in words
        and "serve" in words
        or any(w.endswith("sglang_router.launch_router") for w in words)
    )


_current: list[pytest.Item] = []  # the test being set up, run or torn down, with its module fixtures


def track(item: pytest.Item):
    """A hook wrapper's body around each phase of a test: what starts an engine or a server meanwhile is its."""
    _current.append(item)
    try:
        yield
    finally:
        _current.pop()


def _check(what: str, needs: str) -> None:
    if _current and _RANK[layer_of(_current[-1]) or "slow"] < _RANK[needs]:
        item = _current[-1]
        pytest.fail(f"{item.nodeid} is marked {layer_of(item)} but {what}: mark it {needs} (tests/layers.py)")


def starting_a_server() -> None:
    """What a test calls as it starts a server by other means than a command line (tests/zygote.py)."""
    _check("it starts a server process", "server")


def install_guards() -> None:
    """Holds each test, its setup included (a module fixture's engine is the first test's), to its layer."""
    import kiln.engine
    import kiln.scheduler.launch

    popen_init = subprocess.Popen.__init__

    def popen(self, args, *a, **kw):
        if _starts_a_server(args):
            _check("it starts a server process", "server")
        popen_init(self, args, *a, **kw)

    subprocess.Popen.__init__ = popen  # type: ignore[method-assign]
    engine_init = kiln.engine.Engine.__init__

    def engine(self, *a, **kw):
        _check("it builds a kiln.Engine", "engine")
        engine_init(self, *a, **kw)

    kiln.engine.Engine.__init__ = engine  # type: ignore[method-assign]
    build = kiln.scheduler.launch.build_engine

    def build_engine(*a, **kw):
        _check("it builds an engine", "engine")
        return build(*a, **kw)

    kiln.scheduler.launch.build_engine = build_engine
