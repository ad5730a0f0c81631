"""The SGLang backend's calls against the real SGLang sources, lowest and newest supported version.

`sglang_backend.SGLANG_CALLS` lists every SGLang name the backend uses; `test_backend_calls_are_listed` parses
the backend itself (ast) so the list cannot fall behind. For each version the wheel is downloaded from the
package index (`pip download --no-deps`, cached under pytest's cache directory), its sources are parsed with
`ast` — never imported — and every Engine method must exist and accept the keywords the backend passes (with
no other required argument), every ServerArgs field and SamplingParams field must exist, and the methods
`SGLANG_OPTIONAL_SINCE` marks must exist from that version on. The test skips, with pip's reason, when the
index cannot be reached.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from rlhf_mcore.rollout import sglang_backend
from rlhf_mcore.rollout.sglang_backend import (
    SGLANG_CALLS,
    SGLANG_MIN_VERSION,
    SGLANG_NEWEST_CHECKED,
    SGLANG_OPTIONAL_SINCE,
)

pytestmark = pytest.mark.cost(5)

VERSIONS = [SGLANG_MIN_VERSION, SGLANG_NEWEST_CHECKED]
# the wheels' own tags (0.5.23 is built for CPython 3.11 on manylinux_2_34): fixed, so any interpreter gets them
PIP_TARGET = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
              "--platform", "manylinux_2_34_x86_64"]


def download_wheel(version: str, cache_dir: Path) -> Path:
    found = sorted(cache_dir.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *PIP_TARGET, f"sglang=={version}", "-d",
           str(cache_dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"pip download sglang=={version} could not run: {e}")
    found = sorted(cache_dir.glob(f"sglang-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        reason = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        pytest.skip(f"pip download sglang=={version} failed (package index unreachable?): {' | '.join(reason)}")
    return found[0]


class Sources:
    """Parsed modules of one SGLang wheel."""

    def __init__(self, wheel: Path):
        self.zip = zipfile.ZipFile(wheel)
        self.names = set(self.zip.namelist())

    def tree(self, path: str) -> ast.Module:
        return ast.parse(self.zip.read(path).decode(), filename=path)

    def cls(self, path: str, name: str) -> ast.ClassDef:
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"class {name} not found in {path}")

    def glob(self, prefix: str) -> list[str]:
        return sorted(n for n in self.names if n.startswith(prefix) and n.endswith(".py"))


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def fields(cls: ast.ClassDef) -> set[str]:
    """Annotated class-level names (dataclass / msgspec fields), ClassVar excluded."""
    out = set()
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and "ClassVar" not in ast.unparse(
                n.annotation):
            out.add(n.target.id)
    return out


def server_args_fields(src: Sources) -> set[str]:
    """ServerArgs' fields: its own (0.5.3: a dataclass), plus, where ServerArgs is assembled from namespaces
    (0.5.23: `_INPUT_NAMESPACES`, classes in sglang/srt/arg_groups/fields/), those namespaces' fields."""
    out = fields(src.cls("sglang/srt/server_args.py", "ServerArgs"))
    namespaces = set()
    for node in ast.walk(src.tree("sglang/srt/server_args.py")):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                for t in node.targets):
            namespaces = {e.id for e in node.value.elts if isinstance(e, ast.Name)}
    for path in src.glob("sglang/srt/arg_groups/fields/"):
        for node in ast.walk(src.tree(path)):
            if isinstance(node, ast.ClassDef) and node.name in namespaces:
                out |= fields(node)
                namespaces.discard(node.name)
    assert not namespaces, f"ServerArgs namespaces not found in arg_groups/fields/: {sorted(namespaces)}"
    return out


def sampling_params_fields(src: Sources) -> set[str]:
    cls = src.cls("sglang/srt/sampling/sampling_params.py", "SamplingParams")
    init = methods(cls).get("__init__")
    if init is not None:  # 0.5.3: a plain class with keyword arguments
        return {a.arg for a in init.args.args[1:] + init.args.kwonlyargs}
    return fields(cls)  # 0.5.23: a msgspec Struct


def accepts(fn: ast.FunctionDef, keywords: tuple[str, ...]) -> str | None:
    """None when `fn(self, **{k: ... for k in keywords})` binds; else why not."""
    a = fn.args
    positional = a.posonlyargs + a.args
    names = [x.arg for x in positional[1:]] + [x.arg for x in a.kwonlyargs]
    unknown = [k for k in keywords if k not in names] if a.kwarg is None else []
    if unknown:
        return f"no parameter(s) {unknown} (has {names})"
    n_default = len(a.defaults)
    required = [x.arg for x in positional[1:len(positional) - n_default]] + \
        [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    missing = [r for r in required if r not in keywords]
    return f"required parameter(s) {missing} not passed" if missing else None


def wheel_cache(request) -> Path:
    """pytest's cache directory for the wheels; a temporary one when the cache plugin is off (-p no:cacheprovider)."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("sglang_wheels"))
    path = Path(tempfile.gettempdir()) / "rlhf_mcore_sglang_wheels"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module", params=VERSIONS)
def sglang_sources(request):
    return request.param, Sources(download_wheel(request.param, wheel_cache(request)))


def test_engine_methods(sglang_sources):
    version, src = sglang_sources
    engine = methods(src.cls("sglang/srt/entrypoints/engine.py", "Engine"))
    problems = []
    for name, keywords in SGLANG_CALLS.items():
        if not name.startswith("Engine."):
            continue
        method = name.split(".", 1)[1]
        since = SGLANG_OPTIONAL_SINCE.get(name)
        if method not in engine:
            if since is None or Version(version) >= Version(since):
                problems.append(f"{name}: missing")
            continue
        if since is not None and Version(version) < Version(since):
            problems.append(f"{name}: present in {version}, before {since} — SGLANG_OPTIONAL_SINCE is wrong")
        why = accepts(engine[method], keywords)
        if why:
            problems.append(f"{name}: {why}")
    assert not problems, f"sglang {version}: " + "; ".join(problems)


def test_server_args_fields(sglang_sources):
    version, src = sglang_sources
    missing = set(SGLANG_CALLS["ServerArgs"]) - server_args_fields(src)
    assert not missing, f"sglang {version}: ServerArgs has no field(s) {sorted(missing)}"


def test_sampling_params_fields(sglang_sources):
    version, src = sglang_sources
    missing = set(SGLANG_CALLS["SamplingParams"]) - sampling_params_fields(src)
    assert not missing, f"sglang {version}: SamplingParams has no field(s) {sorted(missing)}"


def test_output_format_names(sglang_sources):
    """The keys `parse_sglang_output` reads are the ones the tokenizer manager writes."""
    version, src = sglang_sources
    text = src.zip.read("sglang/srt/managers/tokenizer_manager.py").decode()
    for key in ("output_token_logprobs", "output_ids", "finish_reason"):
        assert f'"{key}"' in text, f"sglang {version}: tokenizer_manager.py never writes {key!r}"


def test_version_before_the_minimum_lacks_sampling_seed(request):
    """Why SGLANG_MIN_VERSION is 0.5.3: 0.5.2's SamplingParams has no `sampling_seed`."""
    src = Sources(download_wheel("0.5.2", wheel_cache(request)))
    assert "sampling_seed" not in sampling_params_fields(src)
    assert Version("0.5.2") < Version(SGLANG_MIN_VERSION)


def test_subprocess_watchdog_is_where_shutdown_looks(request):
    """`shutdown` stops `engine.tokenizer_manager._subprocess_watchdog` (it would SIGQUIT the trainer when the
    engine's processes end); it exists in the newest version."""
    src = Sources(download_wheel(SGLANG_NEWEST_CHECKED, wheel_cache(request)))
    assert "tokenizer_manager._subprocess_watchdog = " in src.zip.read("sglang/srt/entrypoints/engine.py").decode()
    assert "stop" in methods(src.cls("sglang/srt/utils/watchdog.py", "SubprocessWatchdog"))


def _calls_in_backend() -> dict[str, set[str]]:
    """What the backend calls, read from its source: `self._call("m", kw=...)`, `hasattr(self.engine, "m")`,
    and `self.engine.m` attribute uses."""
    tree = ast.parse(Path(sglang_backend.__file__).read_text())
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_call" \
                and node.args and isinstance(node.args[0], ast.Constant):
            found.setdefault(f"Engine.{node.args[0].value}", set()).update(k.arg for k in node.keywords)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr" \
                and ast.unparse(node.args[0]) == "self.engine" and isinstance(node.args[1], ast.Constant):
            found.setdefault(f"Engine.{node.args[1].value}", set())
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self.engine":
            found.setdefault(f"Engine.{node.attr}", set())
    return found


def test_backend_calls_are_listed():
    calls = _calls_in_backend()
    assert {"Engine.generate", "Engine.update_weights_from_tensor", "Engine.begin_weight_update"} <= set(calls)
    for name, keywords in calls.items():
        assert name in SGLANG_CALLS, f"the backend uses {name}, which SGLANG_CALLS does not list"
        assert keywords <= set(SGLANG_CALLS[name]), f"{name}: {sorted(keywords - set(SGLANG_CALLS[name]))} unlisted"
