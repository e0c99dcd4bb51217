"""The container images, as far as they can be checked without a container engine: pinned bases, a
non-root user, entrypoints that exist, a build context that holds what the Dockerfiles copy, and
their install commands, run as written in a fresh virtualenv on a copy of that build context.

Not covered here: the build itself, the CUDA base's libraries and the CUDA wheels (this machine
gets torch's CPU wheel for the same pinned version), and multi-architecture builds.
"""

from __future__ import annotations

import json
import re
import shlex
import functools
import shutil
import subprocess
import tempfile
import venv
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from fleet.manifests.engine import build_engine_deployment
from fleet.validation import validate

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "images" / "engine" / "Dockerfile"
OPERATOR = ROOT / "images" / "operator" / "Dockerfile"


@dataclass(frozen=True)
class Dockerfile:
    """The instructions of one Dockerfile, with continuation lines joined and ARG defaults applied."""

    instructions: list[tuple[str, str]]

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        logical = re.sub(r"\\\n", " ", path.read_text())
        args: dict[str, str] = {}
        out = []
        for line in logical.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            keyword, _, rest = line.partition(" ")
            rest = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), rest.strip())
            if keyword.upper() == "ARG" and "=" in rest:
                name, _, default = rest.partition("=")
                args[name] = default
            out.append((keyword.upper(), rest))
        return cls(out)

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        return self.all(keyword)[-1]

    def copies(self) -> list[tuple[list[str], str]]:
        """(sources, destination) of each COPY from the build context (not from another stage)."""
        out = []
        for rest in self.all("COPY"):
            if rest.startswith("--from="):
                continue
            *sources, dest = shlex.split(rest)
            out.append((sources, dest))
        return out

    def pip_installs(self) -> list[list[str]]:
        """The arguments of every `pip install` the image runs, in order."""
        out = []
        for rest in self.all("RUN"):
            for command in rest.split("&&"):
                words = shlex.split(command)
                if "pip" in [Path(w).name for w in words] and "install" in words:
                    out.append(words[words.index("install") + 1:])
        return out


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def _pattern_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return out


def ignored(relative: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a directory matches all below it."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negated = raw.startswith("!")
        regex = _pattern_regex(raw.lstrip("!").strip("/"))
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def build_context(dockerfile: Dockerfile, where: Path) -> Path:
    """The WORKDIR as the Dockerfile's COPYs fill it from the repository, minus what .dockerignore drops."""
    patterns = dockerignore()

    def skip(directory: str, entries: list[str]) -> list[str]:
        base = Path(directory).relative_to(ROOT)
        return [e for e in entries if ignored((base / e).as_posix(), patterns)]

    for sources, dest in dockerfile.copies():
        for source in sources:
            assert not ignored(source.rstrip("/"), patterns), f".dockerignore drops {source}, which the image copies"
            target = where / dest
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=skip, dirs_exist_ok=True)
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / source, target / Path(source).name)
    return where


def install_as_the_image_does(dockerfile: Dockerfile, where: Path) -> Path:
    """A fresh virtualenv with every `pip install` of the Dockerfile run in its build context; its bin/."""
    context = build_context(dockerfile, where / "context")
    venv.create(where / "venv", with_pip=True)
    bin_dir = where / "venv" / "bin"
    for args in dockerfile.pip_installs():
        result = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--no-compile", *args], cwd=context,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"pip install {' '.join(args)} failed:\n{result.stderr[-3000:]}"
    return bin_dir


def run(*command: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=120)


# The install checks' virtualenvs, by the test that uses each: most of a minute of pip. tests/conftest.py
# starts them when collection ends, one after the other in a thread that only waits on pip, so they run
# beside the tests before theirs; the fixtures take them when their tests come.
INSTALLS = {
    "test_operator_install_works_in_a_fresh_virtualenv_without_torch": OPERATOR,
    "test_engine_install_works_in_a_fresh_virtualenv": ENGINE,
}
_installer = ThreadPoolExecutor(1, thread_name_prefix="image-install")


@functools.cache
def installing(dockerfile: Path) -> tuple[Future[Path], Path]:
    """The install of `dockerfile`, started once: (its bin/ to come, the directory to remove afterwards)."""
    where = Path(tempfile.mkdtemp(prefix=f"{dockerfile.parent.name}-image-"))
    return _installer.submit(install_as_the_image_does, Dockerfile.read(dockerfile), where), where


def installed(dockerfile: Path) -> Iterator[Path]:
    bin_dir, where = installing(dockerfile)
    try:
        yield bin_dir.result()
    finally:
        shutil.rmtree(where, ignore_errors=True)  # the engine's: about a gigabyte


@pytest.fixture(scope="module")
def operator_venv() -> Iterator[Path]:
    yield from installed(OPERATOR)


@pytest.fixture(scope="module")
def engine_venv() -> Iterator[Path]:
    yield from installed(ENGINE)


def test_dockerignore_keeps_what_the_images_copy_and_nothing_else() -> None:
    patterns = dockerignore()
    for dockerfile in (Dockerfile.read(ENGINE), Dockerfile.read(OPERATOR)):
        for sources, _ in dockerfile.copies():
            for source in sources:
                assert (ROOT / source).exists(), source
                assert not ignored(source.rstrip("/"), patterns), source
    for kept in ("engine/cli.py", "operator/fleet/cli.py", "pyproject.toml"):
        assert not ignored(kept, patterns), kept
    for dropped in (".git/HEAD", ".tools/bin/helm", ".venv/bin/python", "tests/fleet/test_images.py", "docs/install.md",
                    "charts/deepseek-fleet-operator/Chart.yaml", "engine/__pycache__/cli.cpython-312.pyc",
                    "operator/fleet/__pycache__/cli.cpython-312.pyc", "deepseek_fleet.egg-info/PKG-INFO"):
        assert ignored(dropped, patterns), dropped


def test_bases_are_pinned_to_exact_versions() -> None:
    engine_bases = Dockerfile.read(ENGINE).all("FROM")
    operator_bases = [b.split()[0] for b in Dockerfile.read(OPERATOR).all("FROM")]
    assert len(engine_bases) == 1 and re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-runtime-ubuntu\d+\.\d+(@sha256:\w+)?",
                                                   engine_bases[0]), engine_bases
    assert len(set(operator_bases)) == 1 and re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+(@sha256:\w+)?",
                                                          operator_bases[0]), operator_bases


@pytest.mark.parametrize("path", [ENGINE, OPERATOR], ids=["engine", "operator"])
def test_images_run_as_a_numeric_non_root_user(path: Path) -> None:
    user = Dockerfile.read(path).last("USER")
    match = re.fullmatch(r"(\d+)(:\d+)?", user)
    assert match and int(match[1]) != 0, f"USER {user}: Kubernetes checks runAsNonRoot only for numeric ids"


def test_entrypoints_are_the_console_scripts_the_operator_runs() -> None:
    scripts = set(re.findall(r'^(deepseek-\w+) = "', (ROOT / "pyproject.toml").read_text(), re.M))
    engine, operator = Dockerfile.read(ENGINE), Dockerfile.read(OPERATOR)
    assert json.loads(operator.last("ENTRYPOINT")) == ["deepseek-operator"]
    assert json.loads(engine.last("ENTRYPOINT")) == ["deepseek-engine"] and json.loads(engine.last("CMD")) == ["serve"]
    assert {"deepseek-engine", "deepseek-operator"} <= scripts
    # The operator runs the engine image with its own command, and `hf` in it for hf:// models.
    example = yaml.safe_load((ROOT / "examples" / "hf-download.yaml").read_text())
    parent = validate({**example, "metadata": {**example["metadata"], "namespace": "ns"}})
    pod = build_engine_deployment(parent, replicas=1, kv_auth_hash=None)["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == json.loads(engine.last("ENTRYPOINT"))
    assert pod["initContainers"][0]["command"][0] == "hf"


def test_engine_image_pins_torch_and_installs_it_first() -> None:
    installs = Dockerfile.read(ENGINE).pip_installs()
    packages = [[a for a in args if not a.startswith("-")] for args in installs]
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", packages[0][0]) and len(packages[0]) == 1, packages[0]
    assert ".[engine]" in packages[1] and any(re.fullmatch(r"huggingface_hub==[\d.]+", p) for p in packages[1])


def test_operator_image_installs_the_operator_extra_only() -> None:
    installs = Dockerfile.read(OPERATOR).pip_installs()
    assert [[a for a in args if not a.startswith("-")] for args in installs] == [[".[operator]"]]
    assert all(sources != ["engine/"] for sources, _ in Dockerfile.read(OPERATOR).copies())


@pytest.mark.timeout(600)
def test_operator_install_works_in_a_fresh_virtualenv_without_torch(operator_venv: Path) -> None:
    python = operator_venv / "python"
    assert run(python, "-c", "import torch").returncode != 0, "the operator image must not carry torch"
    help_ = run(operator_venv / "deepseek-operator", "--help")
    assert help_.returncode == 0 and "--namespace" in help_.stdout, help_.stderr
    # Every module the running operator imports, handlers included, resolves with the extra alone.
    imported = run(python, "-c", "import fleet.handlers, fleet.cli")
    assert imported.returncode == 0, imported.stderr
    assert run(python, "-c", "import engine").returncode != 0, "the operator image copies no engine code"


@pytest.mark.slow  # about 70 s: torch and the engine's dependencies, installed fresh
@pytest.mark.timeout(900)
def test_engine_install_works_in_a_fresh_virtualenv(engine_venv: Path) -> None:
    python = engine_venv / "python"
    version = re.search(r"torch==([\d.]+)", " ".join(Dockerfile.read(ENGINE).pip_installs()[0]))[1]
    torch = run(python, "-c", "import torch; print(torch.__version__)")
    assert torch.returncode == 0 and torch.stdout.startswith(version), torch.stdout + torch.stderr
    serve = run(engine_venv / "deepseek-engine", "serve", "--help")  # the entrypoint and its default command
    assert serve.returncode == 0 and "--kv-directory" in serve.stdout, serve.stderr
    # The flags of the operator's download init container exist in the image's `hf`.
    example = yaml.safe_load((ROOT / "examples" / "hf-download.yaml").read_text())
    parent = validate({**example, "metadata": {**example["metadata"], "namespace": "ns"}})
    (download,) = build_engine_deployment(parent, replicas=1, kv_auth_hash=None)["spec"]["template"]["spec"]["initContainers"]
    usage = run(engine_venv / download["command"][0], *download["command"][1:2], "--help")
    assert usage.returncode == 0, usage.stderr
    for flag in (word for word in download["command"] if word.startswith("--")):
        assert flag in usage.stdout, flag
