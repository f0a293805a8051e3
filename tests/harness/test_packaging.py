"""Each workspace member imports only what its pyproject declares.

Packages are installable alone (``uv run --package gem-jagged pytest tests/jagged``), so a module
that imports an undeclared distribution works in the workspace and breaks for a user who installs
one package. This test reads every member's ``pyproject.toml``, collects the top-level names its
source imports (module level and inside functions), and checks each non-standard-library name
against the declared dependencies and optional extras.
"""

import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = sorted(
    p.parent for p in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]
)
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
