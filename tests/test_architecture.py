"""The package layout is the design: each package imports only the packages below it, and no module
imports itself back through others (read from the source, no import needed)."""

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ray_elastic"
# Lowest first. A package may import its own modules and those of the layers below it.
LAYERS = [
    ["errors"],  # what a caller can catch
    ["decide", "task", "tpu"],  # pure decisions; the user's task contract; a TPU slice's shape
    ["detect", "state", "policy"],  # failure evidence; snapshots and checkpoints; scaling and failure policies
    ["config", "observe", "slice"],  # settings; events and results; the slice process (JAX)
    ["control", "sim", "examples"],  # the controller (no Ray); the simulated cluster; example tasks
    ["ray_backend"],  # the controller's backend on Ray: placement groups, actors, keepers, step streams
    ["trainer"],  # ElasticTrainer: the controller wired to the Ray backend
    ["cli"],  # the command line
    ["__main__", "__init__"],  # entry points: ``python -m ray_elastic``, the public API
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ["ray_elastic", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__" and len(parts) > 2:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ray_elastic"):
                for target in [node.module] + [f"{node.module}.{a.name}" for a in node.names]:
                    if target in modules and target != name:
                        edges[name].add(target)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in modules and a.name != name)
    return edges


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_is_in_a_layer():
    packages = {_package(m) for m in _modules()}
    assert packages == {p for layer in LAYERS for p in layer}, packages


def test_no_package_imports_one_above_it_or_beside_it():
    layer_of = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    upward = [
        (m, t)
        for m, targets in _imports(_modules()).items()
        for t in targets
        if _package(m) != _package(t) and layer_of[_package(t)] >= layer_of[_package(m)]
    ]
    assert upward == [], f"imports that go up (or sideways) a layer: {upward}"


def test_no_import_circle():
    edges = _imports(_modules())
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(t) :] + [m, t]))
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(_modules()):
        if m not in state:
            visit(m, [])


def test_the_controller_imports_no_ray():
    """``control`` decides and records; Ray is reached only through the backend it is given: no
    module of it imports ``ray`` (nor ``ray_backend``, which the layers already forbid)."""
    found = []
    for name, path in _modules().items():
        if _package(name) != "control":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{name}: {n}" for n in names if n == "ray" or n.startswith("ray.")]
    assert found == []


def test_the_ray_backend_and_the_fake_offer_what_the_backend_protocol_names():
    """The seam is explicit: every method of ``control.backend.Backend`` exists on ``RayBackend`` and
    on the tests' ``FakeBackend``, taking the protocol's parameters (extra ones only with defaults)."""
    import inspect

    from fake_backend import FakeBackend, FakeRequest, FakeReservation, FakeStreams, FakeWorld

    from ray_elastic.control import backend as seam
    from ray_elastic.ray_backend.backend import RayBackend
    from ray_elastic.ray_backend.cluster_health import RayClusterHealth
    from ray_elastic.ray_backend.keepers import KeeperOwnership
    from ray_elastic.ray_backend.placement import ReplacementRequest, SliceReservation
    from ray_elastic.ray_backend.stepping import StepStreams
    from ray_elastic.ray_backend.world import World

    pairs = [
        (seam.Backend, RayBackend),
        (seam.Backend, FakeBackend),
        (seam.WorldHandle, World),
        (seam.WorldHandle, FakeWorld),
        (seam.Streams, StepStreams),
        (seam.Streams, FakeStreams),
        (seam.Reservation, SliceReservation),
        (seam.Reservation, FakeReservation),
        (seam.ReplacementRequest, ReplacementRequest),
        (seam.ReplacementRequest, FakeRequest),
        (seam.RunOwnership, KeeperOwnership),
        (seam.RunOwnership, FakeBackend),
        (seam.ClusterHealth, RayClusterHealth),
        (seam.ClusterHealth, FakeBackend),
    ]
    problems = []
    for protocol, impl in pairs:
        for name, member in vars(protocol).items():
            if name.startswith("_") or not callable(member):
                continue
            if not callable(getattr(impl, name, None)):
                problems.append(f"{impl.__name__}.{name} missing")
                continue
            want = inspect.signature(member).parameters
            have = inspect.signature(getattr(impl, name)).parameters
            if any(p not in have for p in want if p != "self" and want[p].kind != want[p].VAR_KEYWORD):
                problems.append(f"{impl.__name__}.{name}{inspect.signature(getattr(impl, name))} lacks {list(want)}")
            extra = [
                p
                for p in have
                if p not in want
                and p != "self"
                and have[p].default is inspect.Parameter.empty
                and have[p].kind not in (have[p].VAR_POSITIONAL, have[p].VAR_KEYWORD)
            ]
            if extra:
                problems.append(f"{impl.__name__}.{name} needs {extra}, which the protocol does not pass")
    assert problems == []


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 66  # "about 60"; longer ones say why in a "# Long:" comment


def test_modules_and_functions_stay_small():
    """No module over 400 lines; no function over about 60 unless a ``# Long:`` comment in it says why."""
    big, long = [], []
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) > MAX_MODULE_LINES:
            big.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = lines[node.lineno - 1 : node.end_lineno]
                if len(body) > MAX_FUNCTION_LINES and not any(ln.strip().startswith("# Long:") for ln in body):
                    long.append(f"{name}.{node.name}: {len(body)} lines")
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by role): {big}"
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines without a '# Long:' reason: {long}"
