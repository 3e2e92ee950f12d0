"""Set this repository's GitHub address where it is written: the README's Colab badge and the
Colab notebook's REPO setting (which it clones). Until the repository is published they read
OWNER/REPO, a placeholder: the badge opens no notebook and the clone cell stops with one line.

    python -m dev.set_repo your-name/transformer
"""

import re
import sys
from pathlib import Path

from config import UserError
from nmt.cli import ArgumentParser, run_main

ROOT = Path(__file__).resolve().parent.parent
BADGE = re.compile(r"(colab\.research\.google\.com/github/)([^/\s]+/[^/\s]+)(/blob/main/"
                   r"notebooks/colab\.ipynb)")
SETTING = re.compile(r'(REPO = \\"https://github\.com/)([^"\\]+)(\\")')  # in the JSON text


def repositories(root: Path = ROOT) -> tuple:
    """(the badge's owner/name, the notebook's), as written now."""
    readme = (root / "README.md").read_text(encoding="utf-8")
    notebook = (root / "notebooks" / "colab.ipynb").read_text(encoding="utf-8")
    badge, setting = BADGE.search(readme), SETTING.search(notebook)
    if not badge or not setting:
        raise UserError("the README's Colab badge or the notebook's REPO setting is not where "
                        "this tool looks for it")
    return badge.group(2), setting.group(2)


def set_repository(name: str, root: Path = ROOT):
    """Writes `name` (owner/name) into both places."""
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        raise UserError(f"'{name}' is not a GitHub owner/name (e.g. your-name/transformer)")
    repositories(root)  # both present
    for path, pattern in ((root / "README.md", BADGE),
                          (root / "notebooks" / "colab.ipynb", SETTING)):
        text = path.read_text(encoding="utf-8")
        path.write_text(pattern.sub(lambda m: m.group(1) + name + m.group(3), text),
                        encoding="utf-8")


def main(argv=None):
    parser = ArgumentParser(prog="python -m dev.set_repo",
                            description=__doc__.split("\n\n")[0])
    parser.add_argument("repository", help="owner/name on GitHub")
    args = parser.parse_args(argv)
    set_repository(args.repository)
    print(f"the README's badge and notebooks/colab.ipynb now name {args.repository}",
          file=sys.stderr)


if __name__ == "__main__":
    run_main("python -m dev.set_repo", main)
