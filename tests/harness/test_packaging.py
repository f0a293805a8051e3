"""Each workspace member is a package another project can adopt.

Packages are installable alone (``uv run --package gem-jagged pytest tests/jagged``), so a module
that imports an undeclared distribution works in the workspace and breaks for a user who installs
one package. These tests read every member's ``pyproject.toml`` and source (nothing is imported):

- each non-standard-library name its source imports (module level and inside functions) is a
  declared dependency or optional extra;
- it carries the project's license (a copy of the root ``LICENSE`` in its wheel and sdist, and
  the license metadata), ``py.typed``, and a ``__version__`` that agrees with its metadata;
- triton is required on Linux only (it ships for Linux; elsewhere the reference backends run),
  and a package that launches Triton kernels offers numpy, which Triton's interpreter needs, as
  its ``interpreter`` extra;
- requirements between members carry a version range;
- a package whose names load on first use (a module ``__getattr__``) shows them to type
  checkers: a literal ``__all__``, each name imported under ``if TYPE_CHECKING:``.
"""

import ast
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = sorted(
    p.parent for p in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]
)
LICENSE = "Apache-2.0"
# import name -> distribution name, where they differ
DISTRIBUTION_OF = {
    "yaml": "pyyaml",
    "fbgemm_gpu": "fbgemm-gpu",
    "google": "protobuf",
    "PIL": "pillow",
}


def _requirement_name(req: str) -> str:
    for sep in "<>=!~;[ ":
        req = req.split(sep)[0]
    return req.strip().lower().replace("_", "-")


def _declared(pyproject: dict) -> set[str]:
    project = pyproject["project"]
    names = {_requirement_name(r) for r in project.get("dependencies", [])}
    for extra in project.get("optional-dependencies", {}).values():
        names |= {_requirement_name(r) for r in extra}
    return names


def _imported_top_level(src: Path) -> set[str]:
    names = set()
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_member_imports_only_what_it_declares(member):
    pyproject = tomllib.loads((member / "pyproject.toml").read_text())
    own = {p.name for p in (member / "src").iterdir() if p.is_dir()}
    declared = _declared(pyproject)
    undeclared = []
    for name in sorted(_imported_top_level(member / "src")):
        if name in sys.stdlib_module_names or name in own or name == "__future__":
            continue
        dist = DISTRIBUTION_OF.get(name, name).lower().replace("_", "-")
        if dist not in declared:
            undeclared.append(f"{name} (distribution {dist})")
    assert not undeclared, f"{pyproject['project']['name']} imports undeclared: {undeclared}"


def test_every_member_is_a_root_dependency():
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    root_deps = {_requirement_name(r) for r in root["project"]["dependencies"]}
    for member in MEMBERS:
        name = tomllib.loads((member / "pyproject.toml").read_text())["project"]["name"]
        assert name in root_deps, f"{name} is a workspace member but not a root dependency"


def _pyproject(member: Path) -> dict:
    return tomllib.loads((member / "pyproject.toml").read_text())


def _requirements(project: dict) -> list[Requirement]:
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    for extra in project.get("optional-dependencies", {}).values():
        reqs += [Requirement(r) for r in extra]
    return reqs


def _package_dir(member: Path) -> Path:
    (package,) = [p for p in (member / "src").iterdir() if (p / "__init__.py").exists()]
    return package


def _init_tree(member: Path) -> ast.Module:
    return ast.parse((_package_dir(member) / "__init__.py").read_text())


@pytest.mark.parametrize("member", [ROOT, *MEMBERS], ids=["root", *(m.name for m in MEMBERS)])
def test_member_carries_the_license(member):
    project = _pyproject(member)["project"]
    assert project.get("license") == LICENSE, f"{member.name}: license = {LICENSE!r} expected"
    assert project.get("license-files") == ["LICENSE"], f"{member.name}: license-files"
    # A copy, not a link: the file goes into the member's wheel and sdist on every platform.
    copy = member / "LICENSE"
    assert copy.is_file() and not copy.is_symlink(), f"{copy} missing or a link"
    assert copy.read_bytes() == (ROOT / "LICENSE").read_bytes(), f"{copy} differs from the root's"


@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_member_is_typed(member):
    assert (_package_dir(member) / "py.typed").is_file(), f"{member.name} lacks py.typed"


def _version_lookup(tree: ast.Module) -> tuple[str, str] | None:
    """``(distribution, fallback)`` of ``try: __version__ = version(dist) except
    PackageNotFoundError: __version__ = fallback`` at module level, or None."""
    for node in tree.body:
        if not (isinstance(node, ast.Try) and len(node.body) == 1 and len(node.handlers) == 1):
            continue
        (assign,), handler = node.body, node.handlers[0]
        if not (
            isinstance(assign, ast.Assign)
            and [t.id for t in assign.targets if isinstance(t, ast.Name)] == ["__version__"]
            and isinstance(assign.value, ast.Call)
            and getattr(assign.value.func, "id", None) == "version"
            and getattr(handler.type, "id", None) == "PackageNotFoundError"
            and len(handler.body) == 1
            and isinstance(handler.body[0], ast.Assign)
        ):
            continue
        return ast.literal_eval(assign.value.args[0]), ast.literal_eval(handler.body[0].value)
    return None


@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_member_has_a_version_that_agrees_with_its_metadata(member):
    project = _pyproject(member)["project"]
    lookup = _version_lookup(_init_tree(member))
    assert lookup is not None, (
        f"{project['name']}: __init__.py needs __version__ from importlib.metadata.version, with "
        "a PackageNotFoundError fallback for the source tree on PYTHONPATH"
    )
    assert lookup == (project["name"], project["version"]), lookup


def test_the_version_lookup_reads_what_it_is_for():
    good = """
try:
    __version__ = version("gem-x")
except PackageNotFoundError:
    __version__ = "0.1.0"
"""
    assert _version_lookup(ast.parse(good)) == ("gem-x", "0.1.0")
    assert _version_lookup(ast.parse('__version__ = "0.1.0"')) is None


@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_triton_is_required_on_linux_only(member):
    project = _pyproject(member)["project"]
    for req in _requirements(project):
        if req.name == "triton":
            assert str(req.marker) == 'sys_platform == "linux"', (
                f"{project['name']}: {req} must carry `; sys_platform == 'linux'` (triton ships "
                "for Linux; the reference backends run elsewhere)"
            )


@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_kernel_packages_offer_numpy_for_the_interpreter(member):
    project = _pyproject(member)["project"]
    imports = _imported_top_level(member / "src")
    if "triton" not in imports or project["name"] == "gem-train":
        return
    extra = project.get("optional-dependencies", {}).get("interpreter", [])
    assert "numpy" in {Requirement(r).name for r in extra}, (
        f"{project['name']} launches Triton kernels: its `interpreter` extra must hold numpy"
    )


def test_requirements_between_members_carry_a_version_range():
    versions = {
        _pyproject(m)["project"]["name"]: Version(_pyproject(m)["project"]["version"])
        for m in MEMBERS
    }
    for member in MEMBERS:
        project = _pyproject(member)["project"]
        for req in _requirements(project):
            if req.name not in versions:
                continue
            own = versions[req.name]
            next_minor = Version(f"{own.major}.{own.minor + 1}")
            assert own in req.specifier and next_minor not in req.specifier, (
                f"{project['name']} requires {req}: give a range that holds {own} and stops "
                f"below {next_minor} (e.g. >={own.major}.{own.minor},<{next_minor})"
            )


def _lazy_exports(tree: ast.Module) -> tuple[list[str] | None, set[str]] | None:
    """For a module with a module-level ``__getattr__``: its literal ``__all__`` (None when not
    a literal list) and the names bound under ``if TYPE_CHECKING:``; None for other modules."""
    if not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        return None
    exported, typed = None, set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            if isinstance(node.value, ast.List):
                exported = [ast.literal_eval(e) for e in node.value.elts]
        elif isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom | ast.Import):
                    typed |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
    return exported, typed


@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_lazy_exports_are_visible_to_type_checkers(member):
    found = _lazy_exports(_init_tree(member))
    if found is None:  # names imported at module level: type checkers see them already
        return
    exported, typed = found
    assert exported is not None, f"{member.name}: __all__ must be a literal list"
    missing = sorted(set(exported) - typed)
    assert not missing, f"{member.name}: import these under `if TYPE_CHECKING:`: {missing}"
