"""The project's budgets and shape: lines per file, import direction, the script's reading order."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["common", "config", "distributed", "precision", "images", "patches", "data", "model", "metrics", "safety",
         "checkpoint", "report", "autobatch", "predict", "export", "benchmark"]


def lines(path):
    return len(path.read_text(encoding="utf-8").splitlines())


def package_files():
    return sorted((ROOT / "unet_amp").glob("*.py"))


def test_line_budgets():
    assert lines(ROOT / "train_unet.py") <= 800
    assert all(lines(f) <= 800 for f in package_files())
    outside = {"tests", "tools", "notebooks"}
    product = [f for f in ROOT.rglob("*.py") if not outside & set(f.relative_to(ROOT).parts)
               and not any(part.startswith(".") for part in f.relative_to(ROOT).parts)]
    assert sum(map(lines, product)) <= 6000
    assert lines(ROOT / "README.md") <= 250
    assert lines(ROOT / "BENCHMARKS.md") <= 300


def test_every_module_is_in_the_import_order():
    assert {f.stem for f in package_files()} - {"__init__"} == set(ORDER)


def imported_modules(path):
    """unet_amp modules a file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("unet_amp"):
            found |= {node.module.split(".")[1]} if "." in node.module else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("unet_amp.")}
            assert all(a.name != "train_unet" for a in node.names), path
        if isinstance(node, ast.ImportFrom):
            assert node.module != "train_unet", path
    return found


def test_modules_import_downward_only():
    for f in package_files():
        if f.stem == "__init__":
            continue
        for name in imported_modules(f):
            assert ORDER.index(name) < ORDER.index(f.stem), f"{f.stem} imports {name}"


def test_train_unet_reads_in_call_order():
    tree = ast.parse((ROOT / "train_unet.py").read_text(encoding="utf-8"))
    at = {}
    for node in tree.body:
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)] or [getattr(node, "name", None)]
        for name in names:
            at.setdefault(name, node.lineno)
    wanted = ["CONFIG", "PRESETS", "choose_dtype", "main", "train", "epoch_loop", "train_one_epoch", "evaluate"]
    assert [at[n] for n in wanted] == sorted(at[n] for n in wanted)


def test_no_function_is_defined_twice_or_over_50_lines():
    for f in [ROOT / "train_unet.py", *package_files()]:
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for scope in [tree, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            names = [n.name for n in scope.body if isinstance(n, ast.FunctionDef)]
            assert len(names) == len(set(names)), f
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef):
                assert n.end_lineno - n.lineno < 50, f"{f.name}:{n.name}"
