"""The README is the front door: it must document every CONFIG key (in CONFIG's order, with CONFIG's
default) and the two set-up commands, and its links must lead somewhere. BENCHMARKS.md holds the
measured figures, each section naming its machine, date and command."""
import ast
import re
from pathlib import Path

import train_unet

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text()
CONFIG_ROW = re.compile(r"^\| `(\w+)` \| `?(.*?)`? \|", re.M)


def config_rows():
    """(key, default as written) of the README's config table, in its order."""
    section = README.split("\n## Config\n", 1)[1].split("\n## ", 1)[0]
    return CONFIG_ROW.findall(section)


def test_every_config_key_is_in_the_readme_table():
    documented = set(re.findall(r"^\| `(\w+)` \|", README, re.M))
    assert set(train_unet.CONFIG) <= documented, set(train_unet.CONFIG) - documented


def test_config_table_follows_config_order_and_defaults():
    rows = config_rows()
    assert [key for key, _ in rows] == list(train_unet.CONFIG)
    wrong = {key: written for key, written in rows if ast.literal_eval(written) != train_unet.CONFIG[key]}
    assert not wrong, f"README defaults that differ from CONFIG: {wrong}"


def test_the_cpu_probe_section_gives_the_scripts_thresholds():
    section = " ".join(README.split("\n### CPU probe\n", 1)[1].split("\n### ", 1)[0].split())
    assert f"≥ {train_unet.CPU_PROBE_BF16_MARGIN:.2f}× faster" in section
    assert f"unless the other is ≥ {train_unet.CPU_PROBE_LAYOUT_MARGIN:.2f}× faster" in section
    assert f"more than {train_unet.CPU_PROBE_BUSY_SHARE * 100:.0f} % of the run's cores busy" in section


def test_readme_gives_the_two_setup_commands_that_ci_runs():
    assert "make train" in README and "make test" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def anchor(heading):
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (but - and _), spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text):
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_links_within_and_between_readme_and_benchmarks_resolve():
    docs = {"README.md": README, "BENCHMARKS.md": BENCHMARKS}
    targets = {name: anchors(text) for name, text in docs.items()}
    broken = []
    for name, text in docs.items():
        for target, frag in re.findall(r"\]\(((?:README|BENCHMARKS)\.md)?(?:#([^)]*))?\)", text):
            where = target or name
            if frag and frag not in targets[where]:
                broken.append(f"{name}: {target}#{frag}")
    assert not broken, broken


def test_every_benchmarks_section_names_a_machine_and_a_date():
    machines = re.findall(r"^\| \*\*(.+?)\*\* \|", BENCHMARKS.split("\n## ", 2)[1], re.M)
    assert machines, "BENCHMARKS.md has no machine table"
    named = re.compile("|".join(re.escape(m) for m in machines) + r"|2-core CPU")
    sections = [s for s in re.split(r"(?m)^## ", BENCHMARKS)[1:] if not s.startswith("Machines")]
    undated = [s.splitlines()[0] for s in sections if not re.search(r"\b20\d\d-\d\d-\d\d\b", s)]
    unnamed = [s.splitlines()[0] for s in sections if not named.search(s)]
    assert not undated and not unnamed, f"without a date: {undated}; without a machine: {unnamed}"


def test_the_library_functions_the_readme_names_take_the_arguments_it_shows():
    import inspect

    section = README.split("\n### Using it as a library\n", 1)[1].split("\n## ", 1)[0]
    calls = re.findall(r"`(\w+)\(([^`]*)\)", section)
    assert len(calls) >= 8, calls
    for name, args in calls:
        call = ast.parse(f"{name}({args})", mode="eval").body
        inspect.signature(getattr(train_unet, name)).bind(*call.args)  # the arguments it takes


def test_the_readme_gives_the_archive_size_the_banner_notes_past():
    text = " ".join(README.split())
    assert f"past {train_unet.ARCHIVE_NOTE_BYTES // 2**30} GB there the banner says how much it holds" in text


def test_the_readme_gives_the_inference_notes_thresholds():
    """The README said a row is noted where 'predict timed faster than its forwards alone'; a 0.976x row had no
    such note (the limit is 1/1.03): the README gives the script's limits (user test)."""
    text = " ".join(README.split())
    assert (f"rounds more than {train_unet.NOISY_SPREAD:g}× apart, predict timed under "
            f"1/{train_unet.INFERENCE_FASTER_LIMIT:g} of its forwards alone") in text
