"""The README is the front door: it must document every CONFIG key and the two set-up commands."""
import re
from pathlib import Path

import train_unet

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_config_key_is_in_the_readme_table():
    documented = set(re.findall(r"^\| `(\w+)` \|", README, re.M))
    assert set(train_unet.CONFIG) <= documented, set(train_unet.CONFIG) - documented


def test_readme_gives_the_two_setup_commands_that_ci_runs():
    assert "make train" in README and "make test" in README
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "make test" in ci
