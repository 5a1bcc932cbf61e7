"""The project's own promises: the docs site builds, CI runs the README's test command, and
the packages keep the import rules of docs/architecture.md."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_gives_exactly_two_setup_commands_and_ci_runs_the_test_one():
    """Two commands make an environment: the main recipe's and the tests'. Between them, the
    real-model recipe runs in the first one's environment."""
    commands = readme_commands()
    setup = [c for c in commands if c.startswith("python3 -m venv")]
    assert len(setup) == 2 and commands[0] == setup[0] and commands[-1] == setup[1], commands
    run_recipe, run_tests = setup
    assert all("venv" not in c and "recipes/" in c for c in commands[1:-1]), commands
    assert "pip install" in run_recipe and "recipes/" in run_recipe
    assert run_tests.endswith("pytest")
    assert run_tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_readme_fetches_the_torch_the_lock_pins():
    """The test command has pip fetch the locked CPU torch (uv reads no pip configuration, pip
    does), and uv installs it against the lock's hash: both name the same version."""
    run_tests = readme_commands()[-1]
    lock = (ROOT / "requirements" / "test.lock").read_text()
    locked = re.findall(r"^torch==(\S+) ", lock, re.M)
    fetched = re.findall(r"pip download .*?torch==(\S+) &&", run_tests)
    assert len(locked) == 1 and "+cpu" in locked[0], locked
    assert fetched == locked, (fetched, locked)
    assert "--find-links .venv/wheels -r requirements/test.lock" in run_tests


@pytest.mark.slow
def test_docs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is part of the test extras"
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "losses" / "index.html").exists()
    # Formulas render offline: MathJax is served with the site, nothing from another host.
    assert (tmp_path / "site" / "javascripts" / "tex-svg.js").stat().st_size > 1_000_000
    for page in (tmp_path / "site").rglob("*.html"):
        external = re.findall(
            r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"', page.read_text()
        )
        assert not external, (page, external)


def test_every_subpackage_is_packaged():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        "tunelib." + p.parent.relative_to(ROOT / "tunelib").as_posix().replace("/", ".")
        for p in (ROOT / "tunelib").rglob("__init__.py")
        if p.parent != ROOT / "tunelib"
    } | {"tunelib", "tunelib.kernels"}
    assert listed == on_disk
    assert config["package-dir"]["tunelib.kernels"] == "kernels"


# ---- the import rules of docs/architecture.md -------------------------------------------------

# The private modules every package may import.
SHARED_PRIVATE = {
    "tunelib._validation",
    "tunelib._typing",
    "tunelib._deprecation",
    "tunelib._products",
    "tunelib._numerics",
}


def project_modules() -> dict[str, tuple[Path, bool]]:
    """Every module of tunelib, kernels (installed as tunelib.kernels), recipes and benchmarks:
    its dotted name -> (file, whether it is a package's `__init__`)."""
    roots = {"tunelib": "tunelib", "kernels": "tunelib.kernels"}
    roots |= {"recipes": "recipes", "benchmarks": "benchmarks"}
    modules = {}
    for folder, prefix in roots.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = (path, is_package)
    return modules


def imports(module: str, path: Path, is_package: bool, *, top_level: bool) -> list[str]:
    """The absolute names `module` imports (`from a import b` gives `a.b`); with `top_level`,
    only the imports that run when the module is imported (not those inside functions)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST) -> None:
        if top_level and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.extend(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def owner(module: str) -> str:
    """The package a module belongs to: `tunelib.X` for tunelib's subpackages (kernels too),
    `tunelib` for its top-level modules, the first name for recipes and benchmarks."""
    parts = module.split(".")
    if parts[0] == "tunelib" and len(parts) > 1 and not parts[1].startswith("_"):
        return ".".join(parts[:2])
    return parts[0]


def test_no_package_imports_another_packages_private_module():
    violations = []
    for module, (path, is_package) in project_modules().items():
        for name in imports(module, path, is_package, top_level=False):
            parts = name.split(".")
            shared = ".".join(parts[:2]) in SHARED_PRIVATE
            if parts[0] != "tunelib" or shared or owner(name) == owner(module):
                continue
            if any(part.startswith("_") for part in parts[1:]):
                violations.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not violations, "\n".join(violations)


def test_tunelib_has_no_import_cycle():
    modules = {m: v for m, v in project_modules().items() if m.split(".")[0] == "tunelib"}
    graph = {}
    for module, (path, is_package) in modules.items():
        targets = set()
        for name in imports(module, path, is_package, top_level=True):
            # `from a import b` imports the module a.b if there is one, else a name of a.
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    # Tarjan's strongly connected components: a component of two or more modules is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    assert not cycles, cycles


def third_party_imports(folder: str) -> set[str]:
    """The top-level names of every module outside the standard library and the project that
    the Python files under `folder` import."""
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"tunelib", "kernels", "kit"}


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_import_is_declared_and_every_dependency_is_imported():
    """The library imports only what it declares and declares only what it imports; the
    recipes' imports come from the library's dependencies and the recipes and logging
    extras. optax is declared without being imported: the documented train steps compose
    the losses with it, and `peft`'s optimizer labels are made for `optax.multi_transform`."""
    import importlib.metadata
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {requirement_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    distributions = importlib.metadata.packages_distributions()

    def declared(module: str) -> str:
        return distributions[module][0].lower().replace("_", "-")

    library = {declared(m) for m in third_party_imports("tunelib") | third_party_imports("kernels")}
    assert library <= core, f"imported but not declared: {sorted(library - core)}"
    assert core - library == {"optax"}, f"declared but not imported: {sorted(core - library)}"
    allowed = core | {requirement_name(r) for r in extras["recipes"] + extras["logging"]}
    recipes = {declared(m) for m in third_party_imports("recipes")}
    assert recipes <= allowed, f"recipes import undeclared {sorted(recipes - allowed)}"


def test_no_module_takes_a_private_name_from_another():
    """Modules share what they share under public names (a private module's helpers are named
    without a leading underscore): `from tunelib.x._a import _helper` is a violation, in any
    package (the rollout core, the formats package and the models among them)."""
    violations, modules = [], project_modules()
    for module, (path, _) in modules.items():
        if module.split(".")[0] != "tunelib":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tunelib"):
                taken = [a.name for a in node.names if a.name.startswith("_")]
                # a private module is imported as a module, not taken as a name
                taken = [n for n in taken if f"{node.module}.{n}" not in modules]
                if taken:
                    violations.append(f"{path.relative_to(ROOT)}: {node.module} {taken}")
    assert not violations, "\n".join(violations)
