"""The script reads in the order it runs: its table of contents is its section headers, the run (part II)
comes before the machinery, and reading from main to loss.backward() never jumps backwards."""
import ast
import re
from pathlib import Path

import train_unet

SOURCE = Path(train_unet.__file__).read_text()
TREE = ast.parse(SOURCE)


def headers():
    """(number, title) of every part (====) and section (----) header, in file order."""
    found = []
    for match in re.finditer(r"^# ([-=])\1{99}\n# ([IV]+\.(?:\d+)?) ([^:\n]*)", SOURCE, re.M):
        found.append((match.group(2), match.group(3).rstrip(".")))
    return found


def toc():
    lines = train_unet.__doc__.split("Contents:")[1].split("\n\n")[1].strip().splitlines()
    return [tuple(line.strip().split(":")[0].split(" ", 1)) for line in lines]


def test_table_of_contents_is_the_section_headers():
    assert headers(), "no section headers found"
    assert toc() == headers()


def definitions():
    """{name: line} of the module's top-level functions and classes."""
    return {n.name: n.lineno for n in TREE.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def section_of(line):
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^# [-=]{100}\n# ([IV]+\.(?:\d+)?) ", SOURCE, re.M)]
    offset = sum(len(l) + 1 for l in SOURCE.splitlines()[:line - 1])
    return [name for start, name in starts if start <= offset][-1]


def test_part_one_holds_config_and_presets_only():
    names = [t.id for n in TREE.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
    part_one = [name for name in names if section_of(next(n.lineno for n in TREE.body if isinstance(n, ast.Assign)
                                                          and any(getattr(t, "id", None) == name for t in n.targets)))
                .startswith("I.")]
    assert part_one == ["CONFIG", "PRESETS", "PRESET_USES"]
    assert not [name for name, line in definitions().items() if section_of(line).startswith("I.")]


def test_reading_from_main_to_backward_never_jumps_backwards():
    """The call path main -> ... -> forward_backward is in file order, all in part II."""
    path = ["main", "run_command", "train_main", "train", "run_epoch", "train_one_epoch", "forward_backward"]
    lines = [definitions()[name] for name in path]
    assert lines == sorted(lines), dict(zip(path, lines))
    assert all(section_of(line).startswith("II.") for line in lines)
    body = ast.get_source_segment(SOURCE, next(n for n in TREE.body if getattr(n, "name", "") == "forward_backward"))
    assert ".backward()" in body


def test_no_function_is_longer_than_50_lines():
    long = []
    for node in ast.walk(TREE):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - min([node.lineno] + [d.lineno for d in node.decorator_list]) + 1
            if length > 50:
                long.append((node.name, length))
    assert not long


def test_no_function_or_class_is_defined_twice():
    """A second def of a name replaces the first without a word: a new holds_images (an unlistable folder holds
    none) had silently changed the one check_not_in_a_data_set relies on (one that cannot be listed is taken to)."""
    names = [node.name for node in TREE.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert sorted({name for name in names if names.count(name) > 1}) == []
