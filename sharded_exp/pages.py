"""The documentation installed with this package: ``sharded-exp-docs`` (``python -m sharded_exp.pages``).

    sharded-exp-docs                    # where the pages are, and each page's title
    sharded-exp-docs troubleshooting    # one page, printed (its name, or a part of it)

The pages are the documentation site's sources (``docs/`` in a checkout links to
``sharded_exp/docs``; ``mkdocs serve`` there draws the site). A wheel carries them, so a user
who installed the package without the repository reads the same guide.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

DOCS_DIR = Path(__file__).resolve().parent / "docs"


def pages() -> dict[str, str]:
    """Every page by its name (its path under docs/ without ``.md``) and its title."""
    out = {}
    for path in sorted(DOCS_DIR.rglob("*.md")):
        first = next((line for line in path.read_text().splitlines() if line.startswith("# ")), path.stem)
        out[path.relative_to(DOCS_DIR).with_suffix("").as_posix()] = first.lstrip("# ").strip()
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    known = pages()
    if not args or args[0] in ("-h", "--help"):
        print(f"sharded_exp's documentation (Markdown) is installed in {DOCS_DIR}:")
        width = max(map(len, known))
        for name, title in known.items():
            print(f"  {name:<{width}}  {title}")
        print("sharded-exp-docs NAME prints a page (a part of its name will do).")
        return 0
    wanted = args[0].removesuffix(".md")
    matches = [n for n in known if n == wanted] or [n for n in known if wanted in n]
    if len(matches) != 1:
        how = "matches no page" if not matches else f"matches {len(matches)} pages ({', '.join(matches)})"
        # a misspelled page name: the closest (difflib, as Python's own "did you mean"), by whole name or last part
        by_part = {n.rsplit("/", 1)[-1]: n for n in known}
        meant = difflib.get_close_matches(wanted, [*known, *by_part], n=1, cutoff=0.6) if not matches else []
        hint = f"; did you mean {by_part.get(meant[0], meant[0])}?" if meant else ""
        print(f"error: {wanted!r} {how}{hint}; pages: {', '.join(known)}", file=sys.stderr)
        return 2
    sys.stdout.write((DOCS_DIR / f"{matches[0]}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
